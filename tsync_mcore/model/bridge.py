"""Hugging Face Qwen2 / Qwen3 / Qwen3-MoE / Llama checkpoints <-> Megatron-Core GPTModel.

A small converter of our own (mbridge needs TE and CUDA). Mapping, per decoder layer:

    HF                                   Megatron (local spec | TE spec)           TP split
    input_layernorm                      input_layernorm | linear_qkv.layer_norm_   replicated
    q/k/v_proj (.weight, .bias)          self_attention.linear_qkv                  dim 0 by group
    q_norm / k_norm (Qwen3)              self_attention.q_/k_layernorm              replicated
    o_proj                               self_attention.linear_proj                 dim 1
    post_attention_layernorm             pre_mlp_layernorm | linear_fc1.layer_norm_ replicated
    gate_proj, up_proj                   mlp.linear_fc1 = [gate; up] per rank       dim 0 each
    down_proj                            mlp.linear_fc2                             dim 1

Qwen3-MoE layers (docs/guide/moe.md) replace the MLP rows with

    mlp.gate (router)                    mlp.router                                 replicated
    mlp.experts.{e}.gate_proj, up_proj   mlp.experts.local_experts.{j}.linear_fc1   expert TP dim 0
    mlp.experts.{e}.down_proj            mlp.experts.local_experts.{j}.linear_fc2   expert TP dim 1

where e = ep_rank * (experts / ep) + j: each expert-parallel rank holds a contiguous block.

plus embed_tokens <-> embedding.word_embeddings (dim 0), norm <-> decoder.final_layernorm,
lm_head <-> output_layer (dim 0; absent when embeddings are tied). The fused QKV is
interleaved per query group: [q heads of group g; k_g; v_g] for g in groups.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from safetensors import SafetensorError, safe_open

from tsync_mcore import platform
from tsync_mcore.model.attention import SDPAttention
from tsync_mcore.util.safe_files import ModelDirError, hf_config, hf_weight_map

__all__ = [
    "ModelSpec",
    "build_model",
    "causal_mask",
    "export_hf",
    "export_hf_state_dict",
    "hf_param_names",
    "load_hf_config",
    "load_hf_state_dict",
    "HeadInput",
    "final_hidden",
    "head_input",
    "logits",
]

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


# --------------------------------------------------------------------------- name mapping

# Per-layer Megatron suffix -> (kind, HF suffixes). Kinds: rep (replicated), col (dim-0
# split), row (dim-1 split), qkv (interleaved q/k/v groups, dim-0 split), fc1 ([gate; up]).
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("rep", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.q_layernorm.weight": ("rep", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("rep", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("rep", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.router.weight": ("rep", ("mlp.gate.weight",)),
}
# Expert j of this EP rank -> (kind, HF suffixes with {e}, the global expert index).
_EXPERT_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_fc1.weight": ("fc1", ("mlp.experts.{e}.gate_proj.weight",
                                  "mlp.experts.{e}.up_proj.weight")),
    "linear_fc2.weight": ("row", ("mlp.experts.{e}.down_proj.weight",)),
}
_TOP_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("col", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("rep", ("model.norm.weight",)),
    "output_layer.weight": ("col", ("lm_head.weight",)),
}
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


def _rule(mname: str, expert_offset: int = 0) -> tuple[str, list[str]]:
    """Megatron parameter name -> (kind, HF names). Kinds of expert parameters start with
    "expert_"; their local index j is global expert `expert_offset + j`."""
    if mname in _TOP_RULES:
        kind, hf = _TOP_RULES[mname]
        return kind, list(hf)
    m = _LAYER_RE.fullmatch(mname)
    if m and m.group(2) in _LAYER_RULES:
        kind, hf = _LAYER_RULES[m.group(2)]
        return kind, [f"model.layers.{m.group(1)}.{s}" for s in hf]
    x = _EXPERT_RE.fullmatch(m.group(2)) if m else None
    if x and x.group(2) in _EXPERT_RULES:
        kind, hf = _EXPERT_RULES[x.group(2)]
        e = expert_offset + int(x.group(1))
        return "expert_" + kind, [f"model.layers.{m.group(1)}.{s.format(e=e)}" for s in hf]
    raise KeyError(f"no HF mapping for Megatron parameter {mname!r}")


def is_expert_param(mname: str) -> bool:
    """Whether `mname` (optionally 'module.'-prefixed) is a routed expert's weight: sharded
    over expert parallelism, its grads reduced over the expert-data-parallel group."""
    return ".mlp.experts.local_experts." in mname


def _expert_parallel() -> tuple[int, int, int, int]:
    """(ep rank, ep size, expert-TP rank, expert-TP size); (0, 1, 0, 1) before init."""
    if not ps.model_parallel_is_initialized():
        return 0, 1, 0, 1
    return (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())


def hf_param_names(spec: ModelSpec) -> list[str]:
    """All HF parameter names of `spec`, in HF `named_parameters()` order."""
    names = ["model.embed_tokens.weight"]
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            names.append(p + f"self_attn.{proj}.weight")
            if spec.qkv_bias:
                names.append(p + f"self_attn.{proj}.bias")
        names.append(p + "self_attn.o_proj.weight")
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if spec.moe:
            # HF module order: the experts block, then the router
            for e in range(spec.num_experts):
                names += [p + f"mlp.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")]
            names.append(p + "mlp.gate.weight")
        else:
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not spec.tie:
        names.append("lm_head.weight")
    return names


# --------------------------------------------------------------------------- shard math


def _to_local(kind: str, hf: list[torch.Tensor], spec: ModelSpec, rank: int, tp: int):
    """Full HF tensors -> this TP rank's Megatron tensor."""
    kind = kind.removeprefix("expert_")
    if kind == "rep":
        return hf[0]
    if kind == "col":
        return hf[0].chunk(tp, dim=0)[rank]
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[rank]
    if kind == "fc1":
        return torch.cat([t.chunk(tp, dim=0)[rank] for t in hf], dim=0)
    if kind == "qkv":
        q, k, v = hf
        g, hd, rest = spec.kv_heads, spec.head_dim, q.shape[1:]
        qpg = spec.heads // g
        full = torch.cat(
            [q.reshape(g, qpg * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)],
            dim=1,
        ).reshape(-1, *rest)
        return full.chunk(tp, dim=0)[rank]
    raise AssertionError(kind)


def _from_shards(kind: str, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """All TP ranks' Megatron tensors (rank order) -> full HF tensors."""
    kind = kind.removeprefix("expert_")
    if kind == "rep":
        return [shards[0]]
    if kind == "col":
        return [torch.cat(shards, dim=0)]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind == "qkv":
        full = torch.cat(shards, dim=0)
        g, hd, rest = spec.kv_heads, spec.head_dim, full.shape[1:]
        qpg = spec.heads // g
        full = full.reshape(g, (qpg + 2) * hd, *rest)
        q, k, v = full.split([qpg * hd, hd, hd], dim=1)
        return [
            q.reshape(spec.heads * hd, *rest),
            k.reshape(g * hd, *rest),
            v.reshape(g * hd, *rest),
        ]
    raise AssertionError(kind)


# --------------------------------------------------------------------------- loading


class _HFWeights:
    """Reads tensors by name from a (possibly sharded) safetensors checkpoint."""

    def __init__(self, hf_dir: str) -> None:
        self._dir = hf_dir
        self._map = hf_weight_map(hf_dir)  # headers checked: a truncated file fails here
        self._files: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self._map)

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def get(self, name: str) -> torch.Tensor:
        fname = self._map[name]
        path = os.path.join(self._dir, fname)
        try:
            if fname not in self._files:
                self._files[fname] = safe_open(path, "pt")
            return self._files[fname].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelDirError(f"{path}: cannot read tensor {name!r} ({e})") from None


def load_hf_state_dict(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `hf_dir`, as stored (name -> CPU tensor)."""
    weights = _HFWeights(hf_dir)
    return {name: weights.get(name) for name in weights.names()}


def _load_weights(model: GPTModel, hf_dir: str, spec: ModelSpec) -> None:
    weights = _HFWeights(hf_dir)
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    ep_rank, ep, etp_rank, etp = _expert_parallel()
    offset = ep_rank * (spec.num_experts // ep)
    with torch.no_grad():
        for mname, param in model.named_parameters():
            kind, hf_names = _rule(mname, offset)
            # experts are split over the expert-TP group (megatron: etp defaults to tp)
            rank, tp = (etp_rank, etp) if kind.startswith("expert_") else (tp_rank, tp_size)
            missing = [n for n in hf_names if n not in weights]
            if missing:
                raise ModelDirError(f"model directory {hf_dir}: missing {missing} for "
                                    f"Megatron {mname}")
            hf = [weights.get(n) for n in hf_names]
            try:
                local = _to_local(kind, hf, spec, rank, tp)
            except (RuntimeError, ValueError, IndexError) as e:  # shapes the config contradicts
                raise ModelDirError(f"model directory {hf_dir}: {hf_names[0]}: {e}") from None
            if local.shape != param.shape:
                raise ModelDirError(f"model directory {hf_dir}: {hf_names[0]} gives "
                                    f"{tuple(local.shape)} for {mname}, the config.json "
                                    f"model has {tuple(param.shape)}")
            param.copy_(local)


# --------------------------------------------------------------------------- building


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or RuntimeError (cudnn) without CUDA
        return False
    return True


ATTENTIONS = ("auto", "sdpa", "megatron")


def _layer_spec(spec: ModelSpec, which: str, attention: str = "auto"):
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if which == "auto":
        which = "te" if platform.on_gpu() and _te_available() else "local"
    if which == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts or None, moe_grouped_gemm=False,
            qk_layernorm=spec.qk_norm)
    if which == "local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        # why moe_grouped_gemm=False: SequentialMLP (one MLP per local expert, plain
        # matmuls) runs anywhere; the grouped-GEMM experts need TE or torch's CUDA kernels.
        layer = get_gpt_layer_local_spec(num_experts=spec.num_experts or None,
                                         moe_grouped_gemm=False, qk_layernorm=spec.qk_norm,
                                         normalization="RMSNorm")
        # why: megatron's DotProductAttention materializes and masks the score matrix; on GPU
        # SDPA's flash kernels are the fast path without TE. The CPU default stays megatron's
        # (the committed CPU perf baseline and FP64 equivalences were measured with it).
        if attention == "sdpa" or (attention == "auto" and platform.on_gpu()):
            layer.submodules.self_attention.submodules.core_attention = SDPAttention
        return layer
    raise ValueError(f"spec must be 'auto', 'te' or 'local', got {which!r}")


def unwrap(model: torch.nn.Module) -> GPTModel:
    # why: megatron DDP (and Float16Module) keep the GPTModel in `.module`.
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise TypeError(f"expected a GPTModel (optionally DDP-wrapped), got {type(model)}")
    return model


def attention_mode(model: torch.nn.Module) -> str:
    """FLOP-ledger attention mode of `model`: 'causal' when its kernels skip masked blocks
    (SDPA, TE), 'full' for megatron's DotProductAttention (whole score matrix)."""
    core = unwrap(model).decoder.layers[0].self_attention.core_attention
    return "full" if type(core) is DotProductAttention else "causal"


def _moe_config(spec: ModelSpec, aux_loss_coeff: float) -> dict:
    """TransformerConfig MoE settings routing exactly like Qwen3-MoE.

    HF: p = softmax(router logits) over all experts, keep the top k, and divide by their sum
    when norm_topk_prob. Softmax over all experts renormalised on the top k equals a softmax
    over the top-k logits alone, which is megatron's moe_router_pre_softmax=False; without
    renormalisation the probabilities stay the full softmax's (pre_softmax=True).
    """
    if not spec.moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn,
        moe_router_topk=spec.top_k,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        # why "none" at 0: the aux-loss path does extra work (and all-reduces) for nothing
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        # why alltoall: the expert-parallel dispatch megatron scales with; works on gloo
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # no capacity factor: every routed token reaches its experts, as in HF
        moe_expert_capacity_factor=None,
        # each router gets a RouterReplay, so the learner can replay or record routing
        # (model/routing_replay.py); with no replay set a router routes itself
        moe_enable_routing_replay=True,
        expert_model_parallel_size=_expert_parallel()[1],
    )


def _router_gemm_without_te() -> None:
    # why: megatron 0.16.1's router gating reads `te_general_gemm` unguarded, a name
    # moe_utils only binds when Transformer Engine imports (CPU, or a GPU without TE);
    # None makes it take its own torch matmul path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _transformer_config(spec: ModelSpec, dtype: torch.dtype, tp: int,
                        moe_aux_loss_coeff: float = 0.0) -> TransformerConfig:
    return TransformerConfig(
        **_moe_config(spec, moe_aux_loss_coeff),
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps,  # mcore default 1e-5 is wrong for 1e-6 models
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,  # defaults are 0.1
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,  # fused causal softmax ignores explicit masks
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,  # needs TE/apex norms
        use_cpu_initialization=not platform.on_gpu(),  # False fails on CPU
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )


def build_model(
    hf_dir: str,
    *,
    dtype: torch.dtype = torch.float32,
    spec: str = "auto",
    attention: str = "auto",
    load_weights: bool = True,
    moe_aux_loss_coeff: float = 0.0,
) -> tuple[GPTModel, ModelSpec]:
    """GPTModel for `hf_dir` at the current TP size, with this rank's shard of the weights.

    `spec`: "auto" (TE with CUDA and an importable transformer_engine, else local),
    "te" or "local". `attention` (local spec): "sdpa" (`SDPAttention`), "megatron"
    (`DotProductAttention`), or "auto" (SDPA on GPU). Needs `init_parallel()` first.
    MoE checkpoints (qwen3_moe) take the expert-parallel size `init_parallel(ep=...)` set;
    `moe_aux_loss_coeff` > 0 turns on megatron's load-balancing loss (off for RL).
    """
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("call tsync_mcore.model.parallel.init_parallel() before build_model")
    mspec = load_hf_config(hf_dir)
    tp = ps.get_tensor_model_parallel_world_size()
    if mspec.vocab_size % tp:
        raise ValueError(
            f"vocab_size {mspec.vocab_size} is not divisible by tensor-parallel size {tp}"
        )
    if mspec.kv_heads % tp or mspec.heads % mspec.kv_heads:
        raise ValueError(
            f"need kv_heads ({mspec.kv_heads}) % tp ({tp}) == 0 and heads ({mspec.heads}) "
            f"% kv_heads == 0"
        )
    if mspec.ffn % tp:
        raise ValueError(f"intermediate_size {mspec.ffn} is not divisible by tp {tp}")
    _, ep, _, etp = _expert_parallel()
    if mspec.moe and (mspec.num_experts % ep or mspec.moe_ffn % etp):
        raise ValueError(f"num_experts {mspec.num_experts} must be divisible by ep {ep} and "
                         f"moe_intermediate_size {mspec.moe_ffn} by expert tp {etp}")
    if not mspec.moe and ep > 1:
        raise ValueError(f"expert parallelism (ep {ep}) needs a mixture-of-experts model")
    if mspec.moe:
        _router_gemm_without_te()
    config = _transformer_config(mspec, dtype, tp, moe_aux_loss_coeff)
    config.perform_initialization = not load_weights  # loaded weights overwrite it anyway
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(mspec, spec, attention),
        vocab_size=mspec.vocab_size,
        max_sequence_length=mspec.max_position,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=mspec.tie,
        position_embedding_type="rope",
        rotary_base=mspec.rope_theta,  # default 10000 is wrong for 1e6 models
    )
    # why: WrappedTorchNorm (local spec RMSNorm) is built without a dtype.
    model = model.to(device=platform.device(), dtype=dtype)
    if load_weights:
        _mark_tensor_parallel(model)
        _load_weights(model, hf_dir, mspec)
    if mspec.moe and tp > 1:
        _moe_without_sequence_parallel(model)
    return model, mspec


def _mark_tensor_parallel(model: GPTModel) -> None:
    """Give TP-sharded weights megatron's tensor-parallel attributes.

    why: megatron 0.16 sets them only inside its weight initialisers, which do not run with
    perform_initialization=False (the weights are loaded instead). Without them every
    sharded weight counts as a TP replica, and the optimizer's global grad norm (so the
    clipping) took only TP rank 0's shards: at TP = 2 it read about 1/√2 of the true norm."""
    from megatron.core import tensor_parallel as tpl

    for m in model.modules():
        if isinstance(m, (tpl.ColumnParallelLinear, tpl.VocabParallelEmbedding)):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(m, tpl.RowParallelLinear):
            dims = {"weight": 1}  # a row-parallel bias is whole on every rank
        else:
            continue
        for name, dim in dims.items():
            p = getattr(m, name, None)
            if isinstance(p, torch.nn.Parameter) and not getattr(p, "tensor_model_parallel",
                                                                 False):
                tpl.set_tensor_model_parallel_attributes(p, True, dim, 1)


def _moe_without_sequence_parallel(model: GPTModel) -> None:
    """Let MoE layers train at TP > 1 without sequence parallelism.

    why: megatron 0.16's MoELayer.forward raises in training mode at TP > 1 without
    sequence parallelism, a performance guard ("performance may degrade"): every TP rank
    then routes the whole sequence instead of its slice. The learner's span and packed
    forwards do not run sequence-parallel. With the aux and z losses off (config check),
    `training` changes nothing else in a MoE layer, so its forward runs with it False."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.forward = _eval_mode_forward(layer, layer.forward)


def _eval_mode_forward(layer, forward):
    def run(*args, **kwargs):
        was, layer.training = layer.training, False
        try:
            return forward(*args, **kwargs)
        finally:
            layer.training = was
    return run


# --------------------------------------------------------------------------- export


def _canonical_key(spec_order: dict[str, int]) -> Callable[[str], int]:
    return lambda mname: spec_order[_rule(mname)[1][0]]


# Replicated params whose grads are partial per TP rank: they act on this rank's heads only
# (megatron's finalize_model_grads sums them over TP; sequence parallel is not used here).
_TP_PARTIAL_GRAD = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def export_hf(
    named_tensors: dict[str, torch.Tensor],
    spec: ModelSpec,
    *,
    tp_partial_grads: bool = False,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Megatron-named, TP-local tensors (parameters or same-shaped grads) -> full HF tensors.

    Collective over the TP group when tp > 1: every TP rank must call it with the same names.
    Result: CPU, contiguous, in canonical HF order; no lm_head.weight when embeddings are tied.
    Replicated tensors are taken from this rank, which is right for parameters and for grads
    after `train.finish_grad_sync`. Raw per-rank grads (before it) of the Qwen3 q/k-norm
    weights are partial per TP rank: pass `tp_partial_grads=True` to SUM those over TP.
    """
    order = {n: i for i, n in enumerate(hf_param_names(spec))}
    order.setdefault("lm_head.weight", len(order))
    out = dict(iter_hf(named_tensors, spec, tp_partial_grads=tp_partial_grads,
                       transform=transform))
    return dict(sorted(out.items(), key=lambda kv: order[kv[0]]))


def iter_hf(
    named_tensors: dict[str, torch.Tensor],
    spec: ModelSpec,
    *,
    tp_partial_grads: bool = False,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`export_hf` one Megatron tensor at a time: (HF name, full CPU tensor) pairs, in the
    canonical order of the Megatron names (a fused tensor's HF parts together). At TP > 1
    each step gathers one tensor, so no rank ever holds the whole model; every TP rank
    must drain the iterator in step. `transform(name, local tensor)` runs on each local
    tensor first (LoRA merges its adapters there, model/lora.py); LoRA adapter parameters
    themselves (`.lora.` names) have no HF counterpart and are skipped."""
    tensors = {(k[7:] if k.startswith("module.") else k): v for k, v in named_tensors.items()
               if ".lora." not in k}
    order = {n: i for i, n in enumerate(hf_param_names(spec))}
    order.setdefault("lm_head.weight", len(order))
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    for mname in sorted(tensors, key=_canonical_key(order)):
        kind, hf_names = _rule(mname)
        if spec.tie and hf_names == ["lm_head.weight"]:
            continue
        local = tensors[mname].detach()
        if transform is not None:
            local = transform(mname, local)
        local = local.contiguous()
        if kind.startswith("expert_"):
            yield from _gather_expert(mname, kind, local, spec)
            continue
        if tp > 1 and kind != "rep":
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local, group=group)
        elif tp > 1 and tp_partial_grads and mname.endswith(_TP_PARTIAL_GRAD):
            local = local.clone()
            dist.all_reduce(local, group=group)
            shards = [local]
        else:
            shards = [local]
        for name, full in zip(hf_names, _from_shards(kind, shards, spec)):
            yield name, full.cpu().contiguous()


def _gather_expert(mname: str, kind: str, local: torch.Tensor, spec: ModelSpec
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """One local expert tensor -> its full HF tensors for every EP rank's copy of it:
    gathered over the expert-TP group, then over the expert-parallel group (EP rank r holds
    experts r*L .. r*L+L-1, L = num_experts / ep)."""
    _, ep, _, etp = _expert_parallel()
    if etp > 1:
        shards = [torch.empty_like(local) for _ in range(etp)]
        dist.all_gather(shards, local, group=ps.get_expert_tensor_parallel_group())
    else:
        shards = [local]
    parts = _from_shards(kind, shards, spec)
    per_rank = [parts]
    if ep > 1:
        group = ps.get_expert_model_parallel_group()
        per_rank = [[] for _ in range(ep)]
        for t in parts:
            t = t.contiguous()
            got = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(got, t, group=group)
            for r in range(ep):
                per_rank[r].append(got[r])
    local_experts = spec.num_experts // ep
    for r, tensors in enumerate(per_rank):
        _, names = _rule(mname, r * local_experts)
        for name, full in zip(names, tensors):
            yield name, full.cpu().contiguous()


def export_hf_state_dict(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """`export_hf` of the model's parameters (DDP-wrapped models are fine)."""
    return export_hf(dict(model.named_parameters()), spec)


# --------------------------------------------------------------------------- forward


def causal_mask(seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Megatron's attention mask: bool [1, 1, S, S], True = masked (future positions)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def _forward_inputs(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    # SDPAttention takes None as causal (no mask tensor, causal kernels)
    mask = None if platform.on_gpu() or attention_mode(model) == "causal" else causal_mask(s, tokens.device)
    return dict(input_ids=tokens, position_ids=position_ids, attention_mask=mask)


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Forward `tokens` [B, S] -> logits [B, S, V/tp] (this rank's vocab shard).

    GPTModel (mcore 0.16.1) runs sequence-first internally and transposes the output to
    batch-first when no labels are given. Positions are 0..S-1 per row; the causal mask is
    passed explicitly on CPU (megatron's default one is built on CUDA).
    """
    b, s = tokens.shape
    out = model(**_forward_inputs(model, tokens))
    assert out.shape[:2] == (b, s), f"unexpected logits shape {tuple(out.shape)}"
    return out


@dataclass(frozen=True)
class HeadInput:
    """What the output layer would read, for the fused LM head (kernels/lm_head.py).

    logits = hidden @ weight^T, this rank's vocab shard. `hidden` has passed Megatron's
    copy-to-TP region (identity forward, all-reduce of its gradient over TP), as
    ColumnParallelLinear's input does, so a shard-local backward through it is whole."""

    hidden: torch.Tensor  # [..., H] final-normed hidden states
    weight: torch.Tensor  # [V_local, H]: output_layer.weight, or the tied word embedding


def head_input(model: torch.nn.Module, hidden: torch.Tensor) -> HeadInput:
    """The output layer's input and weight for final-normed `hidden` (any leading shape)."""
    gpt = unwrap(model)
    layer = gpt.output_layer
    if layer.sequence_parallel or layer.bias is not None:
        raise ValueError("the fused LM head supports an output layer without sequence "
                         "parallelism or bias")
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else layer.weight
    if layer.tp_group.size() > 1:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
        hidden = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
    return HeadInput(hidden, weight)


def final_hidden(model: torch.nn.Module, tokens: torch.Tensor) -> HeadInput:
    """`logits` without the output layer: the final-normed hidden states [B, S, H] and the
    output weight, so a fused head computes what it needs from them (kernels/lm_head.py)."""
    b, s = tokens.shape
    gpt = unwrap(model)
    # why: GPTModel._postprocess returns the decoder's (final-normed) output when
    # post_process is off; the rest of the forward is the model's own, unchanged.
    gpt.post_process = False
    try:
        out = model(**_forward_inputs(model, tokens))  # [S, B, H]
    finally:
        gpt.post_process = True
    assert out.shape[:2] == (s, b), f"unexpected hidden shape {tuple(out.shape)}"
    return head_input(gpt, out.transpose(0, 1))
