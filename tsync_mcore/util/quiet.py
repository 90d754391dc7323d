"""Known-harmless warnings, filtered once at the start of a process.

Launchers and CLIs call `install()` before they import Megatron, vLLM or torch.distributed,
so a run's log shows what needs attention. Each entry names the exact message, its category
and the module that issues it; anything else still shows (never a blanket ignore). Add an
entry only with the reason it is harmless.

vLLM's engine core runs in a child process: forked on a CPU (it inherits the filters), or
spawned (GPU, CPU with TP > 1), re-importing the launcher's main module, so a launcher that
calls `install()` at module level covers that child too.
"""

from __future__ import annotations

import logging
import re
import warnings

_TE_APEX = "Transformer Engine and Apex are not installed. "
_APEX_NORM = "Apex is not installed. Falling back to Torch Norm"

# (category, issuing module, exact message). Megatron-Core's fallbacks when Transformer
# Engine / NVIDIA Apex are absent: both are optional here (CPU, or GPU with the local spec),
# and the torch implementations are what the project's tests check.
WARNINGS: list[tuple[type[Warning], str, str]] = [
    (UserWarning, "megatron.core.models.gpt.gpt_layer_specs", _APEX_NORM),
    (UserWarning, "megatron.core.models.backends", _APEX_NORM),
    (UserWarning, "megatron.core.optimizer", _TE_APEX + "Falling back to Torch optimizers."),
    (UserWarning, "megatron.core.optimizer.optimizer",
     _TE_APEX + "Falling back to local implementations of multi_tensor_applier and "
     "multi_tensor_scale"),
    (UserWarning, "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
     _TE_APEX + "Falling back to local implementations of multi_tensor_applier and "
     "multi_tensor_scale"),
    (UserWarning, "megatron.core.optimizer.clip_grads",
     _TE_APEX + "Falling back to local implementations of multi_tensor_applier, "
     "multi_tensor_l2norm, and multi_tensor_scale"),
    # Megatron's TransformerConfig default (no CUDA graphs are captured here)
    (UserWarning, "megatron.core.transformer.transformer_config",
     "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."),
    # torch 2.13 renames that Megatron-Core 0.16 and vLLM have not followed yet
    (FutureWarning, "torch.distributed.c10d_logger",
     "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
     "`torch.distributed.reduce_scatter_single` instead."),
    (FutureWarning, "torch.distributed.c10d_logger",
     "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
     "`torch.distributed.all_gather_single` instead."),
    (FutureWarning, "vllm.triton_utils.dispatcher",
     "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` "
     "instead"),
]

# (logger, exact format string, exact args) of log records that are dropped.
LOG_RECORDS: list[tuple[str, str, tuple]] = [
    # An in-place weight reload: rotary embeddings hold a computed cos/sin cache and no
    # checkpoint weights, so vLLM puts the cache back, as it should, and says so per reload.
    ("vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights",
     ("RotaryEmbedding",)),
]


class _DropKnown(logging.Filter):
    def __init__(self, records: list[tuple[str, tuple]]):
        super().__init__()
        self.records = records

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return (record.msg, args) not in self.records


_installed = False


def install() -> None:
    """Filter the entries above in this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for category, module, message in WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message) + r"\Z",
                                category=category, module=re.escape(module) + r"\Z")
    by_logger: dict[str, list[tuple[str, tuple]]] = {}
    for name, msg, args in LOG_RECORDS:
        by_logger.setdefault(name, []).append((msg, args))
    for name, records in by_logger.items():
        logging.getLogger(name).addFilter(_DropKnown(records))
