"""Mixture-of-experts shapes and routing counts for the FLOP ledger (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report).

`MoeShape` says which layers are MoE and their sizes; `RoutingCounter` records, from a
forward itself, how many tokens each layer's router dispatched to each expert. The ledger
(`flops.train_flops(..., moe=, routing=)`) counts each expert by its routed tokens.

The counter hooks the router modules and reads their decision, so it works on both models:
- Hugging Face `Qwen3MoeForCausalLM`: `model.layers.{i}.mlp.gate` returns
  (logits, top-k weights, top-k indices [T, k]);
- Megatron-Core: `decoder.layers.{i}.mlp.router` (`TopKRouter.forward`) returns
  (probs, routing_map [T, E] bool) — after routing replay, so a replayed routing is counted.
Counts stay on the router's device until `counts()`, one host sync per read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch where a model is counted: the ledger's CLI names a bad --model first
    import torch

__all__ = ["MoeShape", "RoutingCounter", "check_routing", "load_moe"]

# router module names -> layer index: HF `...layers.3.mlp.gate`, Megatron `...layers.3.mlp.router`
_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:gate|router)$")


@dataclass(frozen=True)
class MoeShape:
    """The MoE layers of a model: `experts` per layer, `top_k` routed per token, expert SwiGLU
    width `ffn` (HF `moe_intermediate_size`), and the indices of the MoE `layers` (the rest
    are dense MLPs of the spec's `ffn`)."""

    experts: int
    top_k: int
    ffn: int
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts or self.ffn < 1:
            raise ValueError(f"MoE shape needs 1 <= top_k <= experts and ffn >= 1, got "
                             f"experts={self.experts} top_k={self.top_k} ffn={self.ffn}")
        if list(self.layers) != sorted(set(self.layers)) or any(i < 0 for i in self.layers):
            raise ValueError(f"MoE layers must be distinct, sorted, >= 0: {self.layers}")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "MoeShape | None":
        """Qwen3-MoE / Qwen2-MoE-style config.json keys; None for a dense model.

        Layer i is MoE when it is not in `mlp_only_layers` and (i+1) % decoder_sparse_step == 0
        (transformers' Qwen3MoeDecoderLayer)."""
        # why: transformers 5 writes `num_local_experts` (attribute_map); hub files `num_experts`
        e = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if not e:
            return None
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError("shared experts are not counted by the ledger")
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(cfg["num_hidden_layers"])
                       if i not in dense and (i + 1) % step == 0)
        return cls(int(e), int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                   layers)

    @classmethod
    def of(cls, obj) -> "MoeShape | None":
        """None, a MoeShape, or a `bridge.ModelSpec`: its MoE fields (None for a dense spec;
        the converter builds all-MoE stacks, so every layer)."""
        if obj is None or isinstance(obj, MoeShape):
            return obj
        if not getattr(obj, "num_experts", 0):
            return None
        return cls(obj.num_experts, obj.top_k, obj.moe_ffn, tuple(range(obj.layers)))


def load_moe(hf_dir: str) -> MoeShape | None:
    """MoeShape of a Hugging Face checkpoint dir (None if dense); a bad config is one line."""
    from tsync_mcore.util.safe_files import ModelDirError, hf_config

    cfg = hf_config(hf_dir)
    try:
        return MoeShape.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelDirError(f"{hf_dir}/config.json: MoE keys: {e}") from None


def check_routing(moe: MoeShape, routing: Sequence[Sequence[int]], layers: Sequence[int],
                  tokens: int) -> list[list[int]]:
    """Validated per-layer per-expert token counts: one row per MoE layer in `layers` (those
    the pass runs), `moe.experts` counts each, summing to top_k · tokens (dropless routing)."""
    rows = [list(r) for r in routing]
    if len(rows) != len(layers):
        raise ValueError(f"routing has {len(rows)} rows, the pass runs {len(layers)} MoE "
                         f"layers {tuple(layers)}")
    for i, r in zip(layers, rows):
        if len(r) != moe.experts or any(type(n) is not int or n < 0 for n in r):
            raise ValueError(f"routing of layer {i}: {moe.experts} non-negative int counts "
                             f"expected, got {r}")
        if sum(r) != moe.top_k * tokens:
            raise ValueError(f"routing of layer {i} dispatches {sum(r)} tokens, expected "
                             f"top_k·T = {moe.top_k}·{tokens}: counts from another batch?")
    return rows


class RoutingCounter:
    """Per-layer per-expert token counts of every forward run inside `with` (summed).

        with RoutingCounter(model) as rc:
            ...forwards...
        train_flops(spec, lens, routing=rc.counts())

    Every router forward inside counts, a recomputation's too (an OPD replay in recompute
    mode): wrap the passes whose FLOPs you ask for. At expert parallelism each rank counts
    its own tokens, before dispatch.
    """

    def __init__(self, model: torch.nn.Module):
        import torch
        self._routers: dict[int, torch.nn.Module] = {}
        for name, mod in model.named_modules():
            m = _ROUTER_NAME.search(name)
            if m and isinstance(getattr(mod, "weight", None), torch.Tensor):
                self._routers[int(m.group(1))] = mod
        if not self._routers:
            raise ValueError("no MoE router found (modules named layers.N.mlp.gate / .router)")
        self._acc: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._routers))

    def _hook(self, layer: int, experts: int):
        import torch

        def record(_mod, _args, out) -> None:
            decision = out[-1] if isinstance(out, tuple) else out
            if decision.is_floating_point():  # e.g. a router that returns logits only
                raise TypeError(f"layer {layer} router returned no routing decision "
                                f"(top-k indices or a routing map)")
            if decision.dtype == torch.bool:  # Megatron routing_map [T, E]
                n = decision.reshape(-1, experts).sum(0)
            else:  # HF top-k indices [T, k]
                n = torch.bincount(decision.reshape(-1), minlength=experts)
            acc = self._acc.get(layer)
            self._acc[layer] = n if acc is None else acc + n
        return record

    def __enter__(self) -> "RoutingCounter":
        for i, mod in self._routers.items():
            self._hooks.append(mod.register_forward_hook(self._hook(i, mod.weight.shape[0])))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def reset(self) -> None:
        self._acc.clear()

    def counts(self) -> list[list[int]]:
        """One row per MoE layer that ran, in layer order (one host sync)."""
        import torch
        ran = [i for i in self.layers if i in self._acc]
        if not ran:
            return []
        return [[int(n) for n in row] for row in torch.stack([self._acc[i] for i in ran]).tolist()]
