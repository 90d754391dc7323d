"""A tiny random Qwen3-MoE Hugging Face checkpoint (`Qwen3MoeForCausalLM`) for tests.

Saved by transformers in the on-disk names of released Qwen3-MoE checkpoints
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, router `mlp.gate.weight`), which is what
vLLM and the bridge read. Same tokenizer as `make_tiny_checkpoint`.
"""

from __future__ import annotations

import os

import torch

from tsync_mcore.testing.tiny import _build_tokenizer

__all__ = ["make_tiny_moe_checkpoint", "VLLM_TINY_MOE"]

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
