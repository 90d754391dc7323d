"""The HF Qwen3-MoE model's parameters and grads under the checkpoint's on-disk names.

transformers 5 fuses the experts in memory (`mlp.experts.gate_up_proj` [E, 2I, H] with
[gate; up] per expert, `mlp.experts.down_proj` [E, H, I]); checkpoints, and this project's
exports, store them per expert (`mlp.experts.{e}.gate_proj.weight` ...).
"""

from __future__ import annotations

import torch


def load_hf_moe(hf_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    # eager experts: the per-expert loop, a path written independently of megatron's
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype,
                                                experts_implementation="eager").eval()


def by_disk_name(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{in-memory HF name: tensor} (params or grads) -> {on-disk name: tensor}."""
    out = {}
    for n, t in named.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            pre = n[: -len("gate_up_proj")]
            for e, g in enumerate(t):
                out[f"{pre}{e}.gate_proj.weight"], out[f"{pre}{e}.up_proj.weight"] = g.chunk(2, 0)
        elif n.endswith("mlp.experts.down_proj"):
            pre = n[: -len("down_proj")]
            for e, g in enumerate(t):
                out[f"{pre}{e}.down_proj.weight"] = g
        else:
            out[n] = t
    return out


def grads(model) -> dict[str, torch.Tensor]:
    return by_disk_name({n: p.grad for n, p in model.named_parameters()})
