"""HF weights <-> Megatron parameters: the name mapping, the tensor-parallel shard math,
loading a checkpoint into a built model and exporting one back.

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
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from safetensors import SafetensorError, safe_open

from tsync_mcore.model.bridge.spec import ModelSpec
from tsync_mcore.util.safe_files import ModelDirError, hf_weight_map

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


def param_rule(mname: str, expert_offset: int = 0) -> tuple[str, list[str]]:
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


def expert_parallel_layout() -> tuple[int, int, int, int]:
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


def to_local(kind: str, hf: list[torch.Tensor], spec: ModelSpec, rank: int, tp: int):
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


def from_shards(kind: str, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
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


def load_hf_weights(model: GPTModel, hf_dir: str, spec: ModelSpec) -> None:
    """Copy the checkpoint in `hf_dir` into `model`'s parameters, each rank its own TP and
    expert-parallel shard."""
    weights = _HFWeights(hf_dir)
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    ep_rank, ep, etp_rank, etp = expert_parallel_layout()
    offset = ep_rank * (spec.num_experts // ep)
    with torch.no_grad():
        for mname, param in model.named_parameters():
            kind, hf_names = param_rule(mname, offset)
            # experts are split over the expert-TP group (megatron: etp defaults to tp)
            rank, tp = (etp_rank, etp) if kind.startswith("expert_") else (tp_rank, tp_size)
            missing = [n for n in hf_names if n not in weights]
            if missing:
                raise ModelDirError(f"model directory {hf_dir}: missing {missing} for "
                                    f"Megatron {mname}")
            hf = [weights.get(n) for n in hf_names]
            try:
                local = to_local(kind, hf, spec, rank, tp)
            except (RuntimeError, ValueError, IndexError) as e:  # shapes the config contradicts
                raise ModelDirError(f"model directory {hf_dir}: {hf_names[0]}: {e}") from None
            if local.shape != param.shape:
                raise ModelDirError(f"model directory {hf_dir}: {hf_names[0]} gives "
                                    f"{tuple(local.shape)} for {mname}, the config.json "
                                    f"model has {tuple(param.shape)}")
            param.copy_(local)


# --------------------------------------------------------------------------- export


def _canonical_key(spec_order: dict[str, int]) -> Callable[[str], int]:
    return lambda mname: spec_order[param_rule(mname)[1][0]]


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
        kind, hf_names = param_rule(mname)
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
        for name, full in zip(hf_names, from_shards(kind, shards, spec)):
            yield name, full.cpu().contiguous()


def _gather_expert(mname: str, kind: str, local: torch.Tensor, spec: ModelSpec
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """One local expert tensor -> its full HF tensors for every EP rank's copy of it:
    gathered over the expert-TP group, then over the expert-parallel group (EP rank r holds
    experts r*L .. r*L+L-1, L = num_experts / ep)."""
    _, ep, _, etp = expert_parallel_layout()
    if etp > 1:
        shards = [torch.empty_like(local) for _ in range(etp)]
        dist.all_gather(shards, local, group=ps.get_expert_tensor_parallel_group())
    else:
        shards = [local]
    parts = from_shards(kind, shards, spec)
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
        _, names = param_rule(mname, r * local_experts)
        for name, full in zip(names, tensors):
            yield name, full.cpu().contiguous()


def export_hf_state_dict(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """`export_hf` of the model's parameters (DDP-wrapped models are fine)."""
    return export_hf(dict(model.named_parameters()), spec)
