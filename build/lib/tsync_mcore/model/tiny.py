"""Tiny random Hugging Face checkpoints (Qwen2 / Llama / Qwen3 / Qwen3-MoE) + a local BPE
tokenizer.

No network: the tokenizer is trained here with `tokenizers` on a built-in text.
"""

from __future__ import annotations

import os

import torch

__all__ = ["make_tiny_checkpoint", "CHAT_TEMPLATE", "DEMO_MODEL", "SPECIAL_TOKENS"]

# `make demo`'s model (launch/demo.py); heads=2: vLLM's CPU attention needs head_dim >= 32
DEMO_MODEL = dict(arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2, kv_heads=1,
                  intermediate=128, seed=0)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as used by Qwen.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TEXT = """
The quick brown fox jumps over the lazy dog. A tiny model learns to count: one two three
four five six seven eight nine ten. What is 2 + 3? The answer is 5. What is 7 * 6? It is 42.
User: please solve the problem step by step. Assistant: first we add, then we multiply.
Reinforcement learning streams gradients from rollouts into the learner while the policy
keeps generating; the trainer sums per-sequence gradients and steps the optimizer.
def add(a, b):
    return a + b
print(add(1, 2))  # 3
Numbers 0123456789, punctuation .,;:!?'"()[]{}<>-+=*/\\_|@#$%^&~`, and CAPITALS ABCDEFGHIJKLM
NOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz.
"""

_HF_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def _build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet only fits larger vocabularies; tiny ones keep the bytes
    # seen in the text (enough for tests that encode similar text).
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    full = vocab_size >= len(alphabet) + len(SPECIAL_TOKENS) + 16
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet if full else [],
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_checkpoint(
    out_dir: str,
    arch: str = "qwen2",
    vocab_size: int = 256,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    rope_theta: float = 1e6,
    rms_eps: float = 1e-6,
    head_dim: int | None = None,
    init_std: float = 0.08,
    max_shard_size: str | None = None,
    max_positions: int = 512,
    experts: int = 4,
    top_k: int = 2,
    moe_intermediate: int = 32,
    norm_topk_prob: bool = True,
    router_std: float | None = None,
) -> str:
    """Write config + random safetensors weights + tokenizer to `out_dir`; return it.

    Every weight (norms and biases included) is random so that mapping mistakes show up;
    `head_dim` defaults to hidden // heads (Qwen3 tests may pass a different one);
    `max_shard_size` (e.g. "40KB") writes a sharded checkpoint with an index file.
    qwen3_moe: every layer is sparse (`experts` experts of width `moe_intermediate`, top
    `top_k` routing); transformers 5 fuses the experts in memory, `save_pretrained` writes
    them per expert (`mlp.experts.{e}.gate_proj.weight` ...), as real Qwen3-MoE checkpoints
    store them. `router_std` draws the routers (`mlp.gate.weight`) wider than the rest, so
    that top-k choices are far from ties (routing tests).
    """
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if arch not in _HF_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_HF_CLASSES)}, got {arch!r}")
    cfg_name, model_name = _HF_CLASSES[arch]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_act="silu",
        max_position_embeddings=max_positions,
        rms_norm_eps=rms_eps,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    if arch != "qwen2":
        kwargs["head_dim"] = head_dim or hidden // heads
    elif head_dim not in (None, hidden // heads):
        raise ValueError("qwen2 has head_dim = hidden // heads")
    if arch == "qwen3_moe":
        kwargs.update(num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=moe_intermediate, norm_topk_prob=norm_topk_prob,
                      decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + init_std * torch.randn_like(p))
            elif router_std is not None and name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            else:
                p.normal_(0.0, init_std)
    model = model.to(dtype)
    save_kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kw)
    tokenizer.save_pretrained(out_dir)
    return out_dir
