"""Tiny random GGUF files (llama.cpp's format) written with the `gguf` package's GGUFWriter,
for the importer's tests: the metadata keys and tensor names llama.cpp's converter writes
for Llama / Qwen2 / Qwen3, FP32 tensors, and a byte-level BPE tokenizer ("gpt2")."""

from __future__ import annotations

import json

import numpy as np

from tsync_mcore.model.tiny import CHAT_TEMPLATE, _build_tokenizer

# GGUF's token types (gguf.TokenType): the specials are CONTROL
NORMAL, CONTROL = 1, 3


def _tokenizer_fields(vocab_size: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """tokens (byte-level spelling, as vocab.json has them), their types, merges, special ids."""
    fast = _build_tokenizer(vocab_size)
    vocab = fast.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be 0..n-1"
    model = json.loads(fast.backend_tokenizer.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    special = {name: vocab[name] for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    types = [CONTROL if t in special else NORMAL for t in tokens]
    return tokens, types, merges, special


def write_tiny_gguf(path: str, arch: str = "llama", *, vocab_size: int = 320, hidden: int = 64,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
                    tie: bool = False, seed: int = 0, std: float = 0.08,
                    pre: str | None = "default") -> str:
    """A random `arch` model (llama, qwen2, qwen3) as a GGUF file at `path`; returns it.

    `pre`: tokenizer.ggml.pre, the pre-tokenizer llama.cpp names; "default" writes "qwen2"
    for the Qwen archs (as llama.cpp's converter does) and none for llama (GPT-2's split).

    qwen3: transformers takes head_dim from Qwen3Config's default (128) since its GGUF
    mapping reads no key length, so the tiny Qwen3 uses 128 as real Qwen3 models do."""
    import gguf

    head_dim = 128 if arch == "qwen3" else hidden // heads
    tokens, types, merges, special = _tokenizer_fields(vocab_size)
    vocab_size = len(tokens)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(512)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab_size)
    w.add_tokenizer_model("gpt2")
    if pre == "default":
        pre = "qwen2" if arch in ("qwen2", "qwen3") else None
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(special["<|im_start|>"])
    w.add_eos_token_id(special["<|im_end|>"])
    w.add_pad_token_id(special["<|endoftext|>"])
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def rand(*shape: int, norm: bool = False) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        return (x + np.float32(1.0)) if norm else x

    q, kv = heads * head_dim, kv_heads * head_dim
    w.add_tensor("token_embd.weight", rand(vocab_size, hidden))  # numpy shape = torch shape
    for i in range(layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", rand(hidden, norm=True))
        w.add_tensor(f"{b}.attn_q.weight", rand(q, hidden))
        w.add_tensor(f"{b}.attn_k.weight", rand(kv, hidden))
        w.add_tensor(f"{b}.attn_v.weight", rand(kv, hidden))
        if arch == "qwen2":
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(f"{b}.{name}.bias", rand(n))
        if arch == "qwen3":
            w.add_tensor(f"{b}.attn_q_norm.weight", rand(head_dim, norm=True))
            w.add_tensor(f"{b}.attn_k_norm.weight", rand(head_dim, norm=True))
        w.add_tensor(f"{b}.attn_output.weight", rand(hidden, q))
        w.add_tensor(f"{b}.ffn_norm.weight", rand(hidden, norm=True))
        w.add_tensor(f"{b}.ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(f"{b}.ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(f"{b}.ffn_down.weight", rand(hidden, ffn))
    w.add_tensor("output_norm.weight", rand(hidden, norm=True))
    if not tie:
        w.add_tensor("output.weight", rand(vocab_size, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
