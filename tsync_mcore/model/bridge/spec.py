"""What a checkpoint is: `ModelSpec`, read and checked from an HF config.json (the
architectures the bridge supports, MoE fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tsync_mcore.util.safe_files import ModelDirError, hf_config

_ARCHS = ("qwen2", "qwen3", "qwen3_moe", "llama")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the converter needs, read from the HF config.json."""

    arch: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rms_eps: float
    rope_theta: float
    tie: bool
    qkv_bias: bool
    qk_norm: bool
    max_position: int
    # Mixture of experts (qwen3_moe); num_experts == 0 is a dense model.
    num_experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    norm_topk_prob: bool = False

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        arch = cfg.get("model_type")
        if arch not in _ARCHS:
            raise ValueError(f"unsupported model_type {arch!r}; supported: {_ARCHS}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only silu (SwiGLU) MLPs are supported, got {cfg['hidden_act']!r}")
        if cfg.get("mlp_bias") or (arch != "qwen2" and cfg.get("attention_bias")):
            # why: megatron's add_bias_linear would also add biases we cannot map.
            raise ValueError("attention_bias / mlp_bias checkpoints are not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
        # transformers 5 keeps rope_theta only in rope_parameters; older configs at top level
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        moe = _moe_fields(cfg) if arch == "qwen3_moe" else {}
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn=cfg["intermediate_size"] if arch != "qwen3_moe" else 0,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            tie=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            max_position=cfg.get("max_position_embeddings", 4096),
            **moe,
        )


def _moe_fields(cfg: dict) -> dict:
    """The ModelSpec MoE fields of a Qwen3-MoE config.json (ValueError names the key)."""
    # real checkpoints write num_experts; transformers 5 writes num_local_experts
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.get("num_experts_per_tok")
    ffn = cfg.get("moe_intermediate_size")
    for key, v in (("num_experts", experts), ("num_experts_per_tok", top_k),
                   ("moe_intermediate_size", ffn)):
        if type(v) is not int or v < 1:
            raise ValueError(f"{key} must be a positive integer, got {v!r}")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok {top_k} exceeds num_experts {experts}")
    norm = cfg.get("norm_topk_prob", False)
    if type(norm) is not bool:
        raise ValueError(f"norm_topk_prob must be true or false, got {norm!r}")
    # why: one layer type for the whole stack; Megatron's moe_layer_freq could express
    # dense layers in between, the converter does not map them yet.
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers") not in (None, []):
        raise ValueError("only all-MoE stacks are supported (decoder_sparse_step 1, "
                         "mlp_only_layers [])")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts are not supported")
    return dict(num_experts=experts, top_k=top_k, moe_ffn=ffn, norm_topk_prob=norm)


_HF_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")
_HF_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_HF_OPTIONAL_FLOATS = ("rms_norm_eps", "rope_theta")


def load_hf_config(hf_dir: str) -> ModelSpec:
    """The ModelSpec of `hf_dir`; a broken or unusable config.json is a ModelDirError."""
    path = os.path.join(hf_dir, "config.json")
    cfg = hf_config(hf_dir)
    # Qwen3-MoE configs carry intermediate_size though no layer of theirs uses it
    required = _HF_INTS if cfg.get("model_type") != "qwen3_moe" else _HF_INTS[:-1]
    for k in _HF_INTS + _HF_OPTIONAL_INTS:
        v = cfg.get(k)
        if (v is not None or k in required) and (type(v) is not int or v < 1):
            raise ModelDirError(f"{path}: {k} must be a positive integer, got {v!r}")
    for k in _HF_OPTIONAL_FLOATS:
        v = cfg.get(k)
        if v is not None and (type(v) not in (int, float) or not 0 < v < float("inf")):
            raise ModelDirError(f"{path}: {k} must be a positive number, got {v!r}")
    try:
        return ModelSpec.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelDirError(f"{path}: {e}") from None
