"""Measurement layer (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report): learner FLOPs, MFU, NVML timeline, peak memory,
host cost per served source (ops, synchronising calls, host time: `host.HostCounter`).

Importing this package pulls in neither megatron nor pynvml; `flops.load_spec` and the NVML
sampler import them when used.
"""

import importlib

# name -> the submodule that holds it, loaded on first use (PEP 562): host, memory, mfu and
# moe's counter import torch, and the ledger's command line names a bad --model before that.
_WHERE = {
    **dict.fromkeys(("FlopBreakdown", "LoraShape", "ep_rank_flops", "forward_flops",
                     "frozen_names", "head_recompute_flops", "load_spec", "replay_flops",
                     "span_flops", "train_flops"), "flops"),
    **dict.fromkeys(("MoeShape", "RoutingCounter", "load_moe"), "moe"),
    "HostCounter": "host",
    "MemoryMeter": "memory",
    **dict.fromkeys(("Peak", "detect_peak", "mfu_active", "steady_state"), "mfu"),
    "NvmlSampler": "nvml",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "FlopBreakdown",
    "HostCounter",
    "LoraShape",
    "MemoryMeter",
    "MoeShape",
    "NvmlSampler",
    "Peak",
    "detect_peak",
    "ep_rank_flops",
    "forward_flops",
    "frozen_names",
    "head_recompute_flops",
    "load_moe",
    "load_spec",
    "mfu_active",
    "replay_flops",
    "RoutingCounter",
    "span_flops",
    "steady_state",
    "train_flops",
]
