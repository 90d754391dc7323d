"""Learner model FLOPs from actual tensor shapes (docs/measurement.md), for Qwen2 / Qwen3 / Llama.

Every counted product is a matmul, 2·m·k·n for (m×k)(k×n); norms, RoPE, softmax, SwiGLU and
the loss are elementwise and not counted (as `torch.utils.flop_counter` does not). Per layer:

    qkv_proj     T·H → T·(heads + 2·kv_heads)·head_dim   (GQA shapes; bias adds not counted)
    attn_scores  QK^T per head: pairs · head_dim              (pairs: see below)
    attn_values  AV   per head: pairs · head_dim              (K/V are repeated to all heads)
    out_proj     T·(heads·head_dim) → T·H
    mlp_gate, mlp_up, mlp_down   SwiGLU: T·H→T·F twice, T·F→T·H

plus `vocab_proj` (final hidden → vocabulary) for the positions that get logits (with the
fused LM head, kernels/lm_head.py: the scored positions only; its backward's recompute of
their logits is `head_recompute_flops`, hardware work but not model FLOPs). MoE layers
would replace `_mlp` (router + experts by tokens dispatched); dense models are all we build.

Attention pairs per sequence of length s: `attention="full"` counts s² (Megatron's local
DotProductAttention computes the whole S×S score matrix and masks it: the default, since it is
what executes), `"causal"` counts s(s+1)/2 (a causal flash kernel: `SDPAttention`, TE);
`bridge.attention_mode(model)` says which one a built model runs. A span of n tokens after P
context tokens: n·(P+n) full, n·P + n(n+1)/2 causal.

Backward follows what Megatron-Core 0.16.1 executes (tensor_parallel/layers.py):
- a trainable linear weight: input-grad + weight-grad (2× forward), always;
- a frozen one (`requires_grad=False`, `linear_with_frozen_weight`): input-grad only, and only
  when its input requires grad (otherwise autograd never reaches it);
- attention (plain autograd bmm): a grad for each operand that requires grad.
Which activations require grad is propagated through the model from the `frozen` names, so
e.g. a frozen embedding and frozen first layers cost no backward at all.

TP: all figures are whole-model FLOPs (summed over the TP group). Every counted matmul is
split evenly by Megatron's column/row-parallel layers (heads, kv_heads, ffn and vocab are
divisible by tp), so one TP rank executes exactly `total / tp`: `FlopBreakdown.per_rank(tp)`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # why: importing bridge pulls in megatron; the ledger itself needs neither
    from tsync_mcore.model.bridge import ModelSpec

__all__ = [
    "ATTENTION_MODES",
    "COMPONENTS",
    "FlopBreakdown",
    "forward_flops",
    "frozen_names",
    "load_spec",
    "replay_flops",
    "span_flops",
    "train_flops",
]

ATTENTION_MODES = ("full", "causal")
COMPONENTS = (
    "qkv_proj",
    "attn_scores",
    "attn_values",
    "out_proj",
    "mlp_gate",
    "mlp_up",
    "mlp_down",
    "vocab_proj",
)

Frozen = Callable[[str], bool] | Collection[str] | None

# TE-spec names of the fused pre-norms -> the local-spec names the ledger queries.
_TE_NORM_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def load_spec(hf_dir: str) -> "ModelSpec":
    """ModelSpec of a Hugging Face checkpoint dir (`bridge.load_hf_config`)."""
    from tsync_mcore.model.bridge import load_hf_config

    return load_hf_config(hf_dir)


def frozen_names(model) -> frozenset[str]:
    """Megatron names (local-spec spelling, no `module.` prefix) of the frozen parameters."""
    out = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        while name.startswith("module."):
            name = name[len("module."):]
        for te, local in _TE_NORM_ALIASES.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
        out.add(name)
    return frozenset(out)


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward / backward FLOPs of some learner work; `recompute_flops` is not credited.

    `by_component`: component -> {"forward", "backward", "recompute"} FLOPs.
    """

    forward: int
    backward: int
    recompute_flops: int = 0
    by_component: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Credited model FLOPs: forward + backward (activation recomputation excluded)."""
        return self.forward + self.backward

    def __add__(self, other: "FlopBreakdown") -> "FlopBreakdown":
        comps = {k: dict(v) for k, v in self.by_component.items()}
        for k, v in other.by_component.items():
            row = comps.setdefault(k, {"forward": 0, "backward": 0, "recompute": 0})
            for kk, vv in v.items():
                row[kk] = row.get(kk, 0) + vv
        return FlopBreakdown(
            self.forward + other.forward,
            self.backward + other.backward,
            self.recompute_flops + other.recompute_flops,
            comps,
        )

    def per_rank(self, tp: int) -> "FlopBreakdown":
        """What one of `tp` tensor-parallel ranks executes (every matmul is split evenly)."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if any(v % tp for v in (self.forward, self.backward, self.recompute_flops)):
            raise ValueError(f"FLOPs are not divisible by tp={tp}: shapes not TP-shardable")
        return FlopBreakdown(
            self.forward // tp,
            self.backward // tp,
            self.recompute_flops // tp,
            {k: {kk: vv // tp for kk, vv in v.items()} for k, v in self.by_component.items()},
        )

    def to_dict(self) -> dict:
        return {
            "forward_flops": self.forward,
            "backward_flops": self.backward,
            "total_flops": self.total,
            "recompute_flops": self.recompute_flops,
            "by_component": self.by_component,
        }


# --------------------------------------------------------------------------- the walk


def _trainable_fn(frozen: Frozen) -> Callable[[str], bool]:
    if frozen is None:
        return lambda name: True
    if callable(frozen):
        return lambda name: not frozen(name)
    names = frozenset(frozen)
    return lambda name: name not in names


def _pairs(s: int, past: int, attention: str) -> int:
    """Query-key pairs the attention kernel computes for s queries after `past` keys."""
    if attention == "full":
        return s * (past + s)
    return s * past + s * (s + 1) // 2


@dataclass
class _Pass:
    """One forward pass's products; backward added by the requires-grad rules."""

    trainable: Callable[[str], bool]
    lora: bool
    comps: dict[str, dict[str, int]] = field(default_factory=dict)

    def _add(self, comp: str, fwd: int, bwd: int) -> None:
        row = self.comps.setdefault(comp, {"forward": 0, "backward": 0, "recompute": 0})
        row["forward"] += fwd
        row["backward"] += bwd

    def linear(self, parts: dict[str, int], x_rg: bool, weight: str, adapter: bool) -> bool:
        """Linear layer (one weight, maybe several components); returns output-requires-grad."""
        trainable = self.trainable(weight)
        for comp, f in parts.items():
            # why: megatron's trainable path computes dgrad even for a no-grad input
            bwd = 2 * f if trainable else (f if x_rg else 0)
            self._add(comp, f, bwd)
        return trainable or x_rg or (self.lora and adapter)

    def attention(self, spec: "ModelSpec", pairs: int, q_rg: bool, k_rg: bool, v_rg: bool) -> bool:
        f = 2 * spec.heads * spec.head_dim * pairs
        p_rg = q_rg or k_rg
        self._add("attn_scores", f, f * (q_rg + k_rg))
        self._add("attn_values", f, f * (p_rg + v_rg))
        return p_rg or v_rg


def _walk(
    spec: "ModelSpec",
    lens: Sequence[tuple[int, int]],
    *,
    attention: str,
    logits_tokens: int,
    frozen: Frozen,
    lora: bool,
    context_grad: bool,
    stop_after_kv: bool,
) -> dict[str, dict[str, int]]:
    """Products of one forward over sequences/spans `lens` = [(n, past)], backward rules applied.

    `stop_after_kv`: the pass ends at the last layer's K/V (span.py's recompute / no-logits
    path): the last layer's attention, MLP, final norm and vocab projection do not run.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if any(n < 0 or p < 0 for n, p in lens):
        raise ValueError(f"sequence lengths must be >= 0, got {list(lens)}")
    # why: LoRA freezes every base parameter; the adapters alone are trained
    w = _Pass((lambda name: False) if lora else _trainable_fn(frozen), lora)
    tokens = sum(n for n, _ in lens)
    pairs = sum(_pairs(n, p, attention) for n, p in lens)
    has_past = any(p for _, p in lens)
    h, hd, ffn = spec.hidden, spec.head_dim, spec.ffn
    emb = "embedding.word_embeddings.weight"
    x_rg = w.trainable(emb)  # embedding lookup: no FLOPs, but its grad makes x require grad
    for i in range(spec.layers):
        p = f"decoder.layers.{i}."
        a = p + "self_attention."
        ln_rg = x_rg or w.trainable(p + "input_layernorm.weight")
        qkv_out = 2 * tokens * h * (spec.heads + 2 * spec.kv_heads) * hd
        qkv_rg = w.linear({"qkv_proj": qkv_out}, ln_rg, a + "linear_qkv.weight", adapter=True)
        qkv_rg = qkv_rg or (spec.qkv_bias and w.trainable(a + "linear_qkv.bias"))
        if stop_after_kv and i == spec.layers - 1:
            return w.comps
        q_rg = qkv_rg or (spec.qk_norm and w.trainable(a + "q_layernorm.weight"))
        k_rg = qkv_rg or (spec.qk_norm and w.trainable(a + "k_layernorm.weight"))
        # why: torch.cat([past.k, k]) requires grad when the context leaves collect adjoints
        ctx_rg = context_grad and has_past
        attn_rg = w.attention(spec, pairs, q_rg, k_rg or ctx_rg, qkv_rg or ctx_rg)
        o_rg = w.linear(
            {"out_proj": 2 * tokens * spec.heads * hd * h}, attn_rg, a + "linear_proj.weight",
            adapter=True,
        )
        x_rg = x_rg or o_rg
        m_rg = _mlp(w, spec, p, tokens, x_rg or w.trainable(p + "pre_mlp_layernorm.weight"))
        x_rg = x_rg or m_rg
    fin_rg = x_rg or w.trainable("decoder.final_layernorm.weight")
    out_w = emb if spec.tie else "output_layer.weight"
    w.linear({"vocab_proj": 2 * logits_tokens * h * spec.vocab_size}, fin_rg, out_w, adapter=False)
    return w.comps


def _mlp(w: _Pass, spec: "ModelSpec", p: str, tokens: int, ln_rg: bool) -> bool:
    """Dense SwiGLU MLP: fc1 = [gate; up] (one Megatron weight), fc2 = down."""
    f = 2 * tokens * spec.hidden * spec.ffn
    fc1_rg = w.linear({"mlp_gate": f, "mlp_up": f}, ln_rg, p + "mlp.linear_fc1.weight", True)
    return w.linear({"mlp_down": f}, fc1_rg, p + "mlp.linear_fc2.weight", adapter=True)


def _breakdown(comps: dict[str, dict[str, int]], recompute: bool = False) -> FlopBreakdown:
    comps = {k: comps[k] for k in COMPONENTS if k in comps}
    fwd = sum(c["forward"] for c in comps.values())
    bwd = sum(c["backward"] for c in comps.values())
    if recompute:  # the whole forward is recomputation: not credited
        for c in comps.values():
            c["recompute"], c["forward"] = c["forward"], 0
        return FlopBreakdown(0, bwd, fwd, comps)
    return FlopBreakdown(fwd, bwd, 0, comps)


def _logits_tokens(logits_positions: int | Sequence[int] | None, default: int) -> int:
    if logits_positions is None:
        return default
    n = logits_positions if isinstance(logits_positions, int) else sum(logits_positions)
    if n < 0:
        raise ValueError(f"logits_positions must be >= 0, got {logits_positions}")
    return n


# --------------------------------------------------------------------------- public API


def train_flops(
    spec: "ModelSpec",
    seq_lens: Sequence[int],
    *,
    attention: str = "full",
    logits_positions: int | Sequence[int] | None = None,
    frozen: Frozen = None,
    lora: bool = False,
) -> FlopBreakdown:
    """One forward + backward of independent sequences of lengths `seq_lens`.

    Padded batches: pass the padded lengths (padding that reaches a kernel counts).
    `logits_positions`: positions that go through the vocabulary projection (a count, or one
    count per sequence); default every position. `frozen`: Megatron parameter names (local
    spelling, see `frozen_names`) or a predicate on them. `lora=True`: every base parameter
    is frozen (`frozen` is then ignored) and each decoder linear carries a trainable low-rank
    adapter (its own FLOPs ignored), so the projections' outputs require grad.
    """
    lens = [(int(s), 0) for s in seq_lens]
    comps = _walk(
        spec, lens, attention=attention,
        logits_tokens=_logits_tokens(logits_positions, sum(n for n, _ in lens)),
        frozen=frozen, lora=lora, context_grad=False, stop_after_kv=False,
    )  # fmt: skip
    return _breakdown(comps)


def forward_flops(
    spec: "ModelSpec",
    seq_lens: Sequence[int],
    *,
    attention: str = "full",
    logits_positions: int | Sequence[int] | None = None,
) -> int:
    """Forward FLOPs of independent sequences of lengths `seq_lens`."""
    return train_flops(
        spec, seq_lens, attention=attention, logits_positions=logits_positions
    ).forward


def span_flops(
    spec: "ModelSpec",
    n: int,
    context: int,
    *,
    attention: str = "full",
    logits_positions: int | None = None,
    frozen: Frozen = None,
    lora: bool = False,
    context_grad: bool = True,
) -> FlopBreakdown:
    """Forward + backward of a span of `n` tokens attending to `context` earlier tokens' K/V.

    An OPD turn or a shared-prefix continuation (`model/span.py`): weight products on n tokens,
    QK^T/AV on n×(context+n) pairs (full) or n·context + n(n+1)/2 (causal).
    `context_grad`: the context K/V are leaves collecting adjoints (the default in this
    project), so their grads are computed. `logits_positions=0`: the span stops after the
    last layer's K/V (`span_forward(want_logits=False)`, e.g. a shared prompt).
    """
    stop = logits_positions == 0
    comps = _walk(
        spec, [(int(n), int(context))], attention=attention,
        logits_tokens=_logits_tokens(logits_positions, int(n)),
        frozen=frozen, lora=lora, context_grad=context_grad, stop_after_kv=stop,
    )  # fmt: skip
    return _breakdown(comps)


def head_recompute_flops(spec: "ModelSpec", positions: int) -> FlopBreakdown:
    """The fused LM head's backward recomputes the logits of its `positions` (one more
    T·H·V product, kernels/lm_head.py): recomputation, so not credited as model FLOPs."""
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    f = 2 * int(positions) * spec.hidden * spec.vocab_size
    return FlopBreakdown(0, 0, f, {"vocab_proj": {"forward": 0, "backward": 0, "recompute": f}})


def replay_flops(
    spec: "ModelSpec",
    n: int,
    context: int,
    *,
    mode: str = "recompute",
    attention: str = "full",
    frozen: Frozen = None,
    lora: bool = False,
) -> FlopBreakdown:
    """Deferred OPD replay of one earlier turn: adjoints on its K/V pushed back through it.

    The replayed graph ends at the last layer's K/V. `mode="recompute"` rebuilds it first:
    that forward goes to `recompute_flops` (not credited); `"retain"` reuses the kept graph.
    The replay backward is real gradient work and is credited as backward.
    """
    if mode not in ("recompute", "retain"):
        raise ValueError(f"mode must be 'recompute' or 'retain', got {mode!r}")
    comps = _walk(
        spec, [(int(n), int(context))], attention=attention, logits_tokens=0,
        frozen=frozen, lora=lora, context_grad=True, stop_after_kv=True,
    )  # fmt: skip
    out = _breakdown(comps, recompute=True)
    if mode == "retain":
        return FlopBreakdown(0, out.backward, 0, {
            k: {**v, "recompute": 0} for k, v in out.by_component.items()
        })  # fmt: skip
    return out
