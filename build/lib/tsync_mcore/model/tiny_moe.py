"""Tiny Qwen3-MoE test helpers: the vLLM-sized checkpoint shape (made by
`make_tiny_checkpoint(**VLLM_TINY_MOE)`) and forcing/recording an HF model's routing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


__all__ = ["VLLM_TINY_MOE", "hf_forced_routing", "hf_recorded_routing"]

# vLLM's CPU attention needs head_dim >= 32: hidden 64 over 2 heads. The routers are drawn
# wider than the rest so that top-k choices are far from ties.
VLLM_TINY_MOE = dict(arch="qwen3_moe", vocab_size=300, hidden=64, layers=2, heads=2,
                     kv_heads=1, experts=4, top_k=2, moe_intermediate=32, router_std=0.5)


def _moe_blocks(model) -> list:
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    if not blocks:
        raise ValueError("not a mixture-of-experts model: no layer has a router (mlp.gate)")
    return blocks


@contextmanager
def hf_recorded_routing(model) -> Iterator[dict]:
    """Record the experts an HF Qwen3-MoE model routes each token to in the one forward
    run within the block: `out["experts"]` is [rows, moe_layers, top_k] int64, rows in
    HF's order (batch-major: b_idx * seq_len + position)."""
    got: list[list[torch.Tensor]] = [[] for _ in _moe_blocks(model)]
    hooks = [blk.gate.register_forward_hook(
        lambda _m, _inp, out, i=i: got[i].append(out[2].detach().clone()))
        for i, blk in enumerate(_moe_blocks(model))]
    out: dict = {}
    try:
        yield out
        if any(len(g) != 1 for g in got):
            raise RuntimeError("hf_recorded_routing: expected exactly one forward in the block")
        out["experts"] = torch.stack([g[0].long() for g in got], dim=1)
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def hf_forced_routing(model, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, row t of MoE layer l of an HF Qwen3-MoE model goes to the experts
    `experts[t, l, :]` ([rows, moe_layers, top_k], HF's row order), weighted as HF weighs
    its own choice: the softmax over all experts at those experts, renormalised when
    `norm_topk_prob`. The reference for the learner's forced routing."""
    blocks = _moe_blocks(model)
    if experts.dim() != 3 or experts.shape[1] != len(blocks):
        raise ValueError(f"hf_forced_routing: expected [rows, {len(blocks)}, top_k], got "
                         f"{tuple(experts.shape)}")

    def forced(gate, idx):
        def forward(hidden_states):
            h = hidden_states.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(h, gate.weight)
            if idx.shape[0] != logits.shape[0]:
                raise ValueError(f"hf_forced_routing: {idx.shape[0]} rows given, the forward "
                                 f"routes {logits.shape[0]}")
            w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
            if gate.norm_topk_prob:
                w = w / w.sum(dim=-1, keepdim=True)
            return logits, w.to(logits.dtype), idx
        return forward

    for i, blk in enumerate(blocks):
        blk.gate.forward = forced(blk.gate, experts[:, i, :].long())
    try:
        yield
    finally:
        for blk in blocks:
            del blk.gate.forward  # back to the class's forward
