"""LoRA adapters on Megatron-Core's linears, equal to PEFT's per-projection adapters.

PEFT adapts each Hugging Face projection p: y_p = W_p x + s·B_p A_p x, s = α/r (α/√r with
rsLoRA). Megatron fuses q/k/v into one column-parallel `linear_qkv` (interleaved per query
group, model/bridge/) and gate/up into `linear_fc1`, so one adapter per Megatron linear holds the
PEFT pairs of the projections it fuses and lays their outputs out as the base weight does:

    Megatron linear   PEFT projections    A                         B
    linear_qkv        q_proj k_proj v_proj [n·r, H] stacked, repl.   B_q/B_k/B_v rows by group
    linear_fc1        gate_proj up_proj    [n·r, H] stacked, repl.   B_gate/B_up, dim-0 shards
    linear_proj       o_proj               [r, in/tp] dim-1 shard    B [H, r] replicated
    linear_fc2        down_proj            [r, F/tp] dim-1 shard     B [H, r] replicated

(n: how many of the fused projections are targeted; an untargeted one gets no delta.)

Tensor parallelism, column linears: every rank computes a = A x in full; a passes Megatron's
copy-to-TP region, so its gradient (each rank's B shard contributes part) is all-reduced
and A's gradient is whole on every rank. Row linears: each rank's A shard sees its input
shard; a = Σ_ranks A_r x_r is all-reduced (reduce-from-TP), then B acts on the whole a.
Either way replicated adapter parameters get identical, complete gradients on every rank,
and sharded ones get their shard's.

The adapter is a child module of the linear (`<linear>.lora`) applied by a forward hook, so
the base parameter names, the converter (model/bridge/) and every forward path (whole
sequences, spans, packed passes) are unchanged. The base is frozen: Megatron DDP, the
optimizer, clipping and the streaming accumulators see the adapter parameters only.
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from safetensors.torch import save_file

from tsync_mcore.model.lora_spec import (CONFIG_FILE, TARGETS, LoraDirError, LoraSpec,
                                         read_peft_config)
from tsync_mcore.util.safe_files import BadFile, read_safetensors, regular_file

__all__ = [
    "TARGETS",
    "LoraSpec",
    "LoraDirError",
    "attach",
    "adapters",
    "export_adapter",
    "merged_weight",
    "merge_hf",
    "to_local",
    "from_local",
    "peft_names",
    "read_peft_dir",
    "write_peft_dir",
    "n_adapter_params",
]

WEIGHTS_FILE = "adapter_model.safetensors"

# Megatron linear (suffix in a decoder layer) -> (kind, the HF projections it fuses, in order)
_SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("fc1", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
_HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
              "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
              "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj"}
_SHORT = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate", "up_proj": "up"}
_PEFT_RE = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                      r"(\w+_proj)\.lora_([AB])\.weight")


# --------------------------------------------------------------------------- shapes


def _proj_shapes(spec) -> dict[str, tuple[int, int]]:
    """HF projection -> (out, in) of its full weight."""
    h, hd, f = spec.hidden, spec.head_dim, spec.ffn
    return {"q_proj": (spec.heads * hd, h), "k_proj": (spec.kv_heads * hd, h),
            "v_proj": (spec.kv_heads * hd, h), "o_proj": (h, spec.heads * hd),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}


def peft_names(spec, lora: LoraSpec) -> list[str]:
    """PEFT's saved names of the adapter, in `get_peft_model_state_dict` order."""
    out = []
    for i in range(spec.layers):
        for p in TARGETS:
            if p in lora.targets:
                base = f"base_model.model.model.layers.{i}.{_HF_MODULE[p]}"
                out += [f"{base}.lora_A.weight", f"{base}.lora_B.weight"]
    return out


def peft_shapes(spec, lora: LoraSpec) -> dict[str, tuple[int, int]]:
    shapes = _proj_shapes(spec)
    out = {}
    for name in peft_names(spec, lora):
        m = _PEFT_RE.fullmatch(name)
        o, i = shapes[m.group(3)]
        out[name] = (lora.rank, i) if m.group(4) == "A" else (o, lora.rank)
    return out


def n_adapter_params(spec, lora: LoraSpec) -> int:
    """P_A: adapter parameters of the whole model (all TP ranks together)."""
    return sum(a * b for a, b in peft_shapes(spec, lora).values())


# --------------------------------------------------------------------------- the adapter


class LoraAdapter(torch.nn.Module):
    """The PEFT pairs of one Megatron linear; `forward(x)` is s·ΣB_p A_p x in its layout."""

    def __init__(self, kind: str, projs: tuple[str, ...], spec, lora: LoraSpec,
                 dtype: torch.dtype, device, tp: int, tp_group) -> None:
        super().__init__()
        self.kind, self.projs, self.rank, self.scale = kind, projs, lora.rank, lora.scale
        self.tp, self.tp_group = tp, tp_group
        self.groups_local = spec.kv_heads // tp
        shapes = _proj_shapes(spec)
        r = lora.rank

        def param(*shape, sharded_dim=None):
            p = torch.nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device))
            if sharded_dim is not None and tp > 1:
                tensor_parallel.set_tensor_model_parallel_attributes(p, True, sharded_dim, 1)
            return p

        if kind == "row":
            out, inp = shapes[projs[0]]
            self.A = param(r, inp // tp, sharded_dim=1)
            self.B = param(out, r)
        else:
            self.A = param(len(projs) * r, shapes[projs[0]][1])
            for p in projs:
                setattr(self, f"B_{_SHORT[p]}", param(shapes[p][0] // tp, r, sharded_dim=0))
        self.all_projs = _SITES[_SITE_OF_KIND[kind]][1]
        self.out_local = {p: shapes[p][0] // tp for p in self.all_projs}

    def B_of(self, proj: str) -> torch.Tensor:
        return self.B if self.kind == "row" else getattr(self, f"B_{_SHORT[proj]}")

    def A_of(self, proj: str) -> torch.Tensor:
        if self.kind == "row":
            return self.A
        j = self.projs.index(proj)
        return self.A[j * self.rank:(j + 1) * self.rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        # 2-D products: Megatron's [S, B, H] activations are often non-contiguous views,
        # which 3-D F.linear runs (and differentiates) as batched bmm calls
        a = F.linear(x.reshape(-1, x.shape[-1]), self.A)
        if self.kind == "row":
            if self.tp > 1:  # Σ over the input shards; identity backward
                a = tensor_parallel.reduce_from_tensor_model_parallel_region(
                    a, group=self.tp_group)
            return (F.linear(a, self.B) * self.scale).view(*lead, -1)
        if self.tp > 1:  # identity forward; all-reduce of a's gradient (B is sharded)
            a = tensor_parallel.copy_to_tensor_model_parallel_region(a, group=self.tp_group)
        parts = dict(zip(self.projs, a.split(self.rank, dim=-1)))
        outs = [F.linear(parts[p], self.B_of(p)) if p in parts
                else a.new_zeros(a.shape[0], self.out_local[p]) for p in self.all_projs]
        return (self._layout(outs, dim=-1) * self.scale).view(*lead, -1)

    def _layout(self, outs: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Per-projection outputs (along `dim`) -> the fused linear's output layout."""
        if self.kind == "fc1":
            return torch.cat(outs, dim=dim)
        g = self.groups_local  # qkv: [q heads of group g; k_g; v_g] for each local group
        d = dim % outs[0].dim()
        return torch.cat([o.unflatten(d, (g, -1)) for o in outs], dim=d + 1).flatten(d, d + 1)

    def delta_weight(self) -> torch.Tensor:
        """s·B·A in the base weight's (local) layout, FP32 — what merging adds."""
        if self.kind == "row":
            return self.scale * (self.B.float() @ self.A.float())
        outs = [self.B_of(p).float() @ self.A_of(p).float() if p in self.projs
                else self.A.new_zeros(self.out_local[p], self.A.shape[1], dtype=torch.float32)
                for p in self.all_projs]
        return self.scale * self._layout(outs, dim=0)


_SITE_OF_KIND = {"qkv": "self_attention.linear_qkv", "fc1": "mlp.linear_fc1",
                 "row": "self_attention.linear_proj"}


_BASE_ONLY: set[int] = set()  # id() of adapted linears forwarding without their adapter


@contextmanager
def base_only(model):
    """Forwards of `model` inside run its frozen base alone (the adapters skipped): the KL
    term's reference policy with LoRA, without a second copy of the weights."""
    from tsync_mcore.model.bridge import unwrap
    for _, _, mod in _sites(unwrap(model)):
        if isinstance(getattr(mod, "lora", None), LoraAdapter):
            _BASE_ONLY.add(id(mod))
    try:
        yield
    finally:
        for _, _, mod in _sites(unwrap(model)):
            _BASE_ONLY.discard(id(mod))


def _hook(module, args, kwargs, output):
    if id(module) in _BASE_ONLY:
        return output
    x = args[0] if args else kwargs.get("input_", kwargs.get("input"))
    out, bias = output[0], output[1:]
    return (_ContiguousGrad.apply(out) + module.lora(_normed_input(module, x)), *bias)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a gradient with canonical strides. Megatron's
    frozen-weight linear computes its input gradient as grad_output.matmul(W); torch folds
    that 3-D product into one 2-D matmul only when the [S, B, out] strides allow it without a
    copy, and the add of the adapter's output returns [S, 1, out] gradients whose size-1
    dimension has an arbitrary stride (still "contiguous"), so it ran as a batched matmul with
    W broadcast over every token instead."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous().view(-1).view(g.shape)


def _normed_input(module, x: torch.Tensor) -> torch.Tensor:
    """The input the base weight multiplies. TE's LayerNormLinear (TE spec) takes the
    un-normed hidden state and norms it inside; PEFT's adapter sees the normed one."""
    w = getattr(module, "layer_norm_weight", None)
    if w is None:
        return x
    if getattr(module, "normalization", "RMSNorm") != "RMSNorm":
        raise ValueError("LoRA on a TE LayerNormLinear supports RMSNorm only")
    gamma = w + 1 if getattr(module, "zero_centered_gamma", False) else w
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)
    return (xf * gamma.float()).to(x.dtype)


# --------------------------------------------------------------------------- attach


def _sites(gpt) -> Iterator[tuple[int, str, torch.nn.Module]]:
    for i, layer in enumerate(gpt.decoder.layers):
        for suffix in _SITES:
            mod = layer
            for part in suffix.split("."):
                mod = getattr(mod, part)
            yield i, suffix, mod


def adapters(model) -> Iterator[tuple[int, str, LoraAdapter]]:
    """(layer, Megatron linear suffix, adapter) of every adapted linear."""
    from tsync_mcore.model.bridge import unwrap
    for i, suffix, mod in _sites(unwrap(model)):
        if isinstance(getattr(mod, "lora", None), LoraAdapter):
            yield i, suffix, mod.lora


def attach(model, spec, lora: LoraSpec, *, init: dict[str, torch.Tensor] | None = None,
           seed: int = 0) -> None:
    """Freeze every base parameter of `model` and hang an adapter on each targeted linear.

    `init`: full PEFT tensors (`read_peft_dir`), or None for PEFT's default initialisation
    (A kaiming-uniform(a=√5) over its full fan-in, B = 0), drawn on the host from `seed` so
    that every TP size starts from the same adapter."""
    from tsync_mcore.model.bridge import unwrap
    gpt = unwrap(model)
    for p in gpt.parameters():
        p.requires_grad_(False)
    tp = ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    full = init if init is not None else _fresh(spec, lora, seed)
    ref = next(gpt.parameters())
    for i, suffix, mod in _sites(gpt):
        kind, all_projs = _SITES[suffix]
        projs = tuple(p for p in all_projs if p in lora.targets)
        if not projs:
            continue
        ad = LoraAdapter(kind, projs, spec, lora, ref.dtype, ref.device, tp, group)
        with torch.no_grad():
            for name, t in _local_tensors(ad, i, full, tp, rank).items():
                getattr(ad, name).copy_(t)
        mod.add_module("lora", ad)
        mod.register_forward_hook(_hook, with_kwargs=True)


def _fresh(spec, lora: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in peft_shapes(spec, lora).items():
        t = torch.zeros(shape, dtype=torch.float32)
        if name.endswith("lora_A.weight"):
            # PEFT's default = nn.Linear's init: kaiming_uniform_(a=√5) → U(±1/√fan_in)
            bound = 1 / math.sqrt(shape[1])
            t.uniform_(-bound, bound, generator=gen)
        out[name] = t
    return out


def _peft_key(layer: int, proj: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_HF_MODULE[proj]}.lora_{which}.weight"


def _local_tensors(ad: LoraAdapter, layer: int, full: dict[str, torch.Tensor], tp: int,
                   rank: int) -> dict[str, torch.Tensor]:
    """This TP rank's tensors of one adapter (its attribute names) from full PEFT tensors."""
    if ad.kind == "row":
        p = ad.projs[0]
        return {"A": full[_peft_key(layer, p, "A")].chunk(tp, dim=1)[rank],
                "B": full[_peft_key(layer, p, "B")]}
    out = {"A": torch.cat([full[_peft_key(layer, p, "A")] for p in ad.projs])}
    for p in ad.projs:  # q/k/v rows are grouped by query group: a dim-0 chunk is whole groups
        out[f"B_{_SHORT[p]}"] = full[_peft_key(layer, p, "B")].chunk(tp, dim=0)[rank]
    return out


def _layout_plan(spec, lora: LoraSpec) -> Iterator[tuple[str, str, str, tuple[str, ...]]]:
    """(Megatron adapter prefix, kind, PEFT projections) of every adapter `attach` makes."""
    for i in range(spec.layers):
        for suffix, (kind, all_projs) in _SITES.items():
            projs = tuple(p for p in all_projs if p in lora.targets)
            if projs:
                yield i, f"decoder.layers.{i}.{suffix}.lora.", kind, projs


def to_local(full: dict[str, torch.Tensor], spec, lora: LoraSpec, tp: int, rank: int
             ) -> dict[str, torch.Tensor]:
    """Megatron-named adapter tensors of TP rank `rank` from full PEFT tensors (meta
    tensors give the shapes a checkpoint must hold)."""
    out = {}
    for i, at, kind, projs in _layout_plan(spec, lora):
        ad = _Layout(kind, projs, lora.rank)
        out.update({at + k: v for k, v in _local_tensors(ad, i, full, tp, rank).items()})
    return out


def from_local(shards: list[dict[str, torch.Tensor]], spec, lora: LoraSpec
               ) -> dict[str, torch.Tensor]:
    """Full PEFT tensors from every TP rank's Megatron-named adapter tensors (rank order);
    a replicated tensor must be equal on every rank."""
    out = {}
    for i, at, kind, projs in _layout_plan(spec, lora):
        def rep(name: str) -> torch.Tensor:
            parts = [s[at + name] for s in shards]
            if any(not torch.equal(parts[0], x) for x in parts[1:]):
                raise ValueError(f"replicated adapter tensor {at + name} differs between TP "
                                 f"ranks")
            return parts[0]

        if kind == "row":
            out[_peft_key(i, projs[0], "A")] = torch.cat([s[at + "A"] for s in shards], dim=1)
            out[_peft_key(i, projs[0], "B")] = rep("B")
            continue
        a = rep("A")
        for j, p in enumerate(projs):
            out[_peft_key(i, p, "A")] = a[j * lora.rank:(j + 1) * lora.rank]
            out[_peft_key(i, p, "B")] = torch.cat([s[at + f"B_{_SHORT[p]}"] for s in shards])
    return {n: out[n].contiguous() for n in peft_names_of(out)}


@dataclass(frozen=True)
class _Layout:  # what _local_tensors reads of an adapter, without building one
    kind: str
    projs: tuple[str, ...]
    rank: int


def merge_hf(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor],
             lora: LoraSpec) -> dict[str, torch.Tensor]:
    """HF weights with the adapter merged in: W_p + s·B_p·A_p (FP32 sum, W's dtype), as
    PEFT's `merge_and_unload` does."""
    out = dict(base)
    for name in adapter:
        m = _PEFT_RE.fullmatch(name)
        if m.group(4) != "A":
            continue
        w = f"model.layers.{m.group(1)}.{m.group(2)}.{m.group(3)}.weight"
        b = adapter[name[: -len("lora_A.weight")] + "lora_B.weight"]
        out[w] = (base[w].float() + lora.scale * (b.float() @ adapter[name].float())
                  ).to(base[w].dtype)
    return out


# --------------------------------------------------------------------------- export


def export_adapter(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full PEFT-named tensors (CPU) from this rank's Megatron-named adapter tensors (the
    parameters, or same-shaped gradients). Collective over TP: every TP rank calls it."""
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    tensors = {(k[7:] if k.startswith("module.") else k): v for k, v in tensors.items()}
    out: dict[str, torch.Tensor] = {}

    def full(name: str, dim: int | None) -> torch.Tensor:
        t = tensors[name].detach().contiguous()
        if tp > 1 and dim is not None:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t, group=group)
            t = torch.cat(shards, dim=dim)
        return t.cpu().contiguous()

    for i, suffix, ad in adapters(model):
        at = f"decoder.layers.{i}.{suffix}.lora."
        if ad.kind == "row":
            p = ad.projs[0]
            out[_peft_key(i, p, "A")] = full(at + "A", 1)
            out[_peft_key(i, p, "B")] = full(at + "B", None)
            continue
        a = full(at + "A", None)
        for j, p in enumerate(ad.projs):
            out[_peft_key(i, p, "A")] = a[j * ad.rank:(j + 1) * ad.rank].contiguous()
            out[_peft_key(i, p, "B")] = full(at + f"B_{_SHORT[p]}", 0)
    return {n: out[n] for n in peft_names_of(out)}


def peft_names_of(tensors: dict[str, torch.Tensor]) -> list[str]:
    """`tensors`' names in PEFT's order (layer, then projection, then A before B)."""
    def key(n: str):
        m = _PEFT_RE.fullmatch(n)
        return int(m.group(1)), TARGETS.index(m.group(3)), m.group(4)
    return sorted(tensors, key=key)


def merged_weight(model):
    """A transform for `bridge.iter_hf`: (Megatron name, tensor) -> W + s·B·A in W's dtype
    for an adapted linear's weight, unchanged otherwise (one merged tensor at a time)."""
    by_weight = {f"decoder.layers.{i}.{suffix}.weight": ad for i, suffix, ad in adapters(model)}

    def transform(mname: str, t: torch.Tensor) -> torch.Tensor:
        ad = by_weight.get(mname)
        return t if ad is None else (t.float() + ad.delta_weight()).to(t.dtype)
    return transform


def is_adapter_param(name: str) -> bool:
    return ".lora." in name


# --------------------------------------------------------------------------- PEFT files


def read_peft_dir(path: str, spec) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """The LoRA spec and full FP32 tensors of a PEFT adapter directory, checked against the
    base model `spec` (every layer, every target, every shape)."""
    try:
        lora = read_peft_config(path)
        wpath = os.path.join(path, WEIGHTS_FILE)
        regular_file(wpath)
        tensors, _ = read_safetensors(wpath)
    except BadFile as e:
        raise LoraDirError(str(e)) from None
    # PEFT saves without the adapter name ("default"); some tools keep it in the key
    tensors = {k.replace(".lora_A.default.weight", ".lora_A.weight")
                .replace(".lora_B.default.weight", ".lora_B.weight"): v
               for k, v in tensors.items()}
    want = peft_shapes(spec, lora)
    missing = [n for n in want if n not in tensors]
    if missing:
        raise LoraDirError(f"{wpath}: missing {missing[0]!r}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                           + f" for r={lora.rank}, targets {list(lora.targets)}")
    extra = [n for n in tensors if n not in want]
    if extra:
        raise LoraDirError(f"{wpath}: unexpected tensor {extra[0]!r} (not an adapter of "
                           f"targets {list(lora.targets)} on this {spec.layers}-layer model)")
    out = {}
    for n, shape in want.items():
        t = tensors[n]
        if tuple(t.shape) != shape:
            raise LoraDirError(f"{wpath}: {n} is {tuple(t.shape)}, the base model and r = "
                               f"{lora.rank} need {shape}")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise LoraDirError(f"{wpath}: {n} is not a finite floating-point tensor")
        out[n] = t.float()
    return lora, out


def write_peft_dir(path: str, lora: LoraSpec, tensors: dict[str, torch.Tensor], *,
                   base_model: str = "", dtype: torch.dtype = torch.float32) -> None:
    """A PEFT adapter directory (`peft.PeftModel.from_pretrained` loads it)."""
    os.makedirs(path, exist_ok=True)
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": 0.0, "target_modules": list(lora.targets),
        "use_rslora": lora.rslora, "use_dora": False, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": base_model, "modules_to_save": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
              os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(cfg, f, indent=2)
