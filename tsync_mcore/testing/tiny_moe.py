"""A tiny random Qwen3-MoE Hugging Face checkpoint (`Qwen3MoeForCausalLM`) for tests.

Saved by transformers in the on-disk names of released Qwen3-MoE checkpoints
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, router `mlp.gate.weight`), which is what
vLLM and the bridge read. Same tokenizer as `make_tiny_checkpoint`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tsync_mcore.testing.tiny import _build_tokenizer

__all__ = ["make_tiny_moe_checkpoint", "VLLM_TINY_MOE", "hf_forced_routing",
           "hf_recorded_routing"]

# vLLM's CPU attention needs head_dim >= 32: hidden 64 over 2 heads.
VLLM_TINY_MOE = dict(vocab_size=300, hidden=64, layers=2, heads=2, kv_heads=1, experts=4, topk=2)


def make_tiny_moe_checkpoint(
    out_dir: str,
    *,
    vocab_size: int = 300,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    experts: int = 4,
    topk: int = 2,
    moe_intermediate: int = 32,
    seed: int = 0,
    init_std: float = 0.08,
    router_std: float = 0.5,
    max_positions: int = 512,
) -> str:
    """Write config + random safetensors weights + tokenizer to `out_dir`; return it.

    Every layer is sparse (no `mlp_only_layers`), top-k probabilities are renormalised
    (`norm_topk_prob`, as Qwen3-30B-A3B), the router's auxiliary loss is off. The router is
    drawn wider than the rest (`router_std`) so that top-k choices are far from ties.
    """
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,  # dense MLP size; unused when every layer is sparse
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        num_experts=experts,
        num_experts_per_tok=topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + init_std * torch.randn_like(p))
            else:
                p.normal_(0.0, router_std if name.endswith("mlp.gate.weight") else init_std)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


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
