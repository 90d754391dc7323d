"""Learner model FLOPs from actual tensor shapes (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report), for Qwen2 / Qwen3 / Llama.

Every counted product is a matmul, 2·m·k·n for (m×k)(k×n); norms, RoPE, softmax, SwiGLU and
the loss are elementwise and not counted (as `torch.utils.flop_counter` does not). Per layer:

    qkv_proj     T·H → T·(heads + 2·kv_heads)·head_dim   (GQA shapes; bias adds not counted)
    attn_scores  QK^T per head: pairs · head_dim              (pairs: see below)
    attn_values  AV   per head: pairs · head_dim              (K/V are repeated to all heads)
    out_proj     T·(heads·head_dim) → T·H
    mlp_gate, mlp_up, mlp_down   SwiGLU: T·H→T·F twice, T·F→T·H

plus `vocab_proj` (final hidden → vocabulary) for the positions that get logits (with the
fused LM head, kernels/lm_head.py: the scored positions only; its backward's recompute of
their logits is `head_recompute_flops`, hardware work but not model FLOPs).

MoE layers (`moe=MoeShape`, ledger/moe.py) replace the dense MLP by
    router       T·H → T·E                                  (RouterGatingLinearFunction)
    expert_gate, expert_up, expert_down   per expert e, on the n_e tokens routed to it:
                 n_e·H → n_e·F_e twice, n_e·F_e → n_e·H     (Σ_e n_e = k·T, dropless)
`routing` gives n_e per MoE layer and expert (`RoutingCounter` records it from the forward);
without it the experts are counted on k·T tokens in all, which is the same total: routing
decides where expert FLOPs run (which expert, which EP rank), not how many there are. Top-k,
softmax, permutation and the probability-weighted combine are not matmuls and not counted.

Attention pairs per sequence of length s: `attention="full"` counts s² (Megatron's local
DotProductAttention computes the whole S×S score matrix and masks it: the default, since it is
what executes), `"causal"` counts s(s+1)/2 (a causal flash kernel: `SDPAttention`, TE);
`bridge.attention_mode(model)` says which one a built model runs. A span of n tokens after P
context tokens: n·(P+n) full, n·P + n(n+1)/2 causal.

Backward follows what Megatron-Core 0.16.1 executes (tensor_parallel/layers.py):
- a trainable linear weight: input-grad + weight-grad (2× forward), always;
- a frozen one (`requires_grad=False`, `linear_with_frozen_weight`): input-grad only, and only
  when its input requires grad (otherwise autograd never reaches it); MoE experts too (the
  sequential experts are these linears);
- the MoE router (moe_utils.RouterGatingLinearFunction): both grads whenever backward reaches
  it (trainable weight or grad-requiring input), even for a frozen weight — where plain
  autograd (Hugging Face) would skip the weight-grad;
- attention (plain autograd bmm): a grad for each operand that requires grad.
Which activations require grad is propagated through the model from the `frozen` names, so
e.g. a frozen embedding and frozen first layers cost no backward at all.

LoRA (`lora=LoraShape(rank, targets)`, or the policy's `model/lora.LoraSpec`): every base
parameter is frozen, and each targeted projection (Hugging Face names: q_proj ... down_proj)
adds two products of its own, counted as `<component>.lora_A` (T·in → T·r) and
`<component>.lora_B` (T·r → T·out). They are plain autograd matmuls on trainable weights:
backward = weight-grad always, plus input-grad where the input requires grad (always for B,
whose input is A's output; for A only where the base linear's input does, so layer 0's q/k/v
adapters, fed by the frozen embedding, get none). A projection's output requires grad where
its input does or an adapter feeds it; Megatron's linear_qkv has one output, so one targeted
q/k/v makes all three require grad (`separate_qkv=True` models peft's separate modules).

TP: all figures are whole-model FLOPs, each product counted once. Megatron's column/row-
parallel layers split every base matmul evenly (heads, kv_heads, ffn and vocab are divisible
by tp; MoE experts by the expert-TP size, Megatron's default = tp). The MoE router is
counted whole on every rank (`TP_REPLICATED`); the learner trains MoE at TP = 1 for now
(Megatron needs sequence parallelism for MoE at TP > 1, which splits it by tokens). A LoRA adapter
is split on one side only: on a column-parallel linear (qkv, fc1) A is replicated on every
rank and B sharded by output; on a row-parallel one (proj, fc2) A is sharded by input and B
replicated after the reduction. `FlopBreakdown.per_rank(tp)` divides
the split components by tp and keeps the replicated ones (`TP_REPLICATED`) whole, so the TP
group executes more than the model FLOPs; MFU credits model FLOPs only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tsync_mcore.observability.ledger.moe import MoeShape, check_routing

if TYPE_CHECKING:  # why: importing bridge pulls in megatron; the ledger itself needs neither
    from tsync_mcore.model.bridge import ModelSpec

__all__ = [
    "ATTENTION_MODES",
    "COMPONENTS",
    "LORA_TARGETS",
    "TP_REPLICATED",
    "FlopBreakdown",
    "LoraShape",
    "MoeShape",
    "ep_rank_flops",
    "forward_flops",
    "frozen_names",
    "load_spec",
    "replay_flops",
    "span_flops",
    "train_flops",
]

ATTENTION_MODES = ("full", "causal")
_BASE_COMPONENTS = (
    "qkv_proj",
    "attn_scores",
    "attn_values",
    "out_proj",
    "mlp_gate",
    "mlp_up",
    "mlp_down",
    "router",
    "expert_gate",
    "expert_up",
    "expert_down",
    "vocab_proj",
)
_ADAPTED = ("qkv_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_down")
COMPONENTS = _BASE_COMPONENTS + tuple(f"{c}.lora_{m}" for c in _ADAPTED for m in "AB")
# Adapter products every TP rank executes whole: A of the column-parallel linears (its input
# is the full hidden state), B of the row-parallel ones (applied after the reduction).
# The MoE router is not split by TP (without sequence parallelism: each rank routes all).
TP_REPLICATED = frozenset({"qkv_proj.lora_A", "mlp_gate.lora_A", "mlp_up.lora_A",
                           "out_proj.lora_B", "mlp_down.lora_B", "router"})
# Hugging Face projection names a LoRA may target, and the component each belongs to.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Frozen = Callable[[str], bool] | Collection[str] | None
LoraLike = Any  # None, a LoraShape, or anything with `.rank` and `.targets` (LoraSpec)
Routing = Sequence[Sequence[int]] | None  # per MoE layer that runs, per expert: tokens routed

# TE-spec names of the fused pre-norms -> the local-spec names the ledger queries.
_TE_NORM_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def load_spec(hf_dir: str) -> "ModelSpec":
    """ModelSpec of a Hugging Face checkpoint dir (`bridge.load_hf_config`)."""
    from tsync_mcore.util.safe_files import hf_config
    hf_config(hf_dir)  # a missing dir or config.json is named before Megatron's import
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
class LoraShape:
    """What the ledger needs of a LoRA policy: the rank and the targeted projections.

    `model/lora.LoraSpec` has the same `rank` and `targets` and may be passed instead.
    `separate_qkv`: q/k/v are separate modules whose outputs require grad on their own
    (Hugging Face + peft); False is Megatron's fused linear_qkv.
    """

    rank: int
    targets: tuple[str, ...] = LORA_TARGETS
    separate_qkv: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if bad or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {LORA_TARGETS}, "
                             f"got {tuple(self.targets)}")

    @classmethod
    def of(cls, lora) -> "LoraShape | None":
        """A LoraShape from None, a LoraShape or anything with `.rank` and `.targets`."""
        if lora is None or isinstance(lora, LoraShape):
            return lora
        return cls(int(lora.rank), tuple(lora.targets))


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
        """What one of `tp` tensor-parallel ranks executes: every base matmul split evenly,
        the `TP_REPLICATED` adapter products whole on each rank."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        rep = {k: v for k, v in self.by_component.items() if k in TP_REPLICATED}

        def share(total: int, key: str) -> int:
            whole = sum(v.get(key, 0) for v in rep.values())
            if (total - whole) % tp:
                raise ValueError(f"FLOPs are not divisible by tp={tp}: shapes not TP-shardable")
            return (total - whole) // tp + whole

        comps = {k: dict(v) if k in rep else {kk: vv // tp for kk, vv in v.items()}
                 for k, v in self.by_component.items()}
        return FlopBreakdown(share(self.forward, "forward"), share(self.backward, "backward"),
                             share(self.recompute_flops, "recompute"), comps)

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
    lora: LoraShape | None
    comps: dict[str, dict[str, int]] = field(default_factory=dict)

    def _add(self, comp: str, fwd: int, bwd: int) -> None:
        row = self.comps.setdefault(comp, {"forward": 0, "backward": 0, "recompute": 0})
        row["forward"] += fwd
        row["backward"] += bwd

    def linear(self, parts: dict[str, int], x_rg: bool, weight: str | bool) -> bool:
        """Linear layer (one weight, maybe several components); returns output-requires-grad.
        `weight`: its name, or whether it is trainable."""
        trainable = weight if isinstance(weight, bool) else self.trainable(weight)
        for comp, f in parts.items():
            # why: megatron's trainable path computes dgrad even for a no-grad input
            bwd = 2 * f if trainable else (f if x_rg else 0)
            self._add(comp, f, bwd)
        return trainable or x_rg

    def router(self, f: int, x_rg: bool, weight: str) -> bool:
        """MoE router gating: Megatron's custom autograd function computes input-grad and
        weight-grad together whenever backward reaches it (a frozen weight too)."""
        rg = self.trainable(weight) or x_rg
        self._add("router", f, 2 * f if rg else 0)
        return rg

    def adapter(self, comp: str, tokens: int, fan_in: int, fan_outs: list[int], x_rg: bool) -> None:
        """LoRA on one linear: A (fan_in → r, stacked for every targeted output) and one B per
        targeted output (r → fan_out); autograd matmuls, so no dgrad for a no-grad input."""
        if not fan_outs:
            return
        r = self.lora.rank
        fa = 2 * tokens * fan_in * r * len(fan_outs)
        self._add(comp + ".lora_A", fa, fa * (1 + x_rg))
        fb = 2 * tokens * r * sum(fan_outs)
        self._add(comp + ".lora_B", fb, 2 * fb)  # B's input (A's output) always requires grad

    def targeted(self, name: str) -> bool:
        return self.lora is not None and name in self.lora.targets

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
    lora: LoraShape | None,
    context_grad: bool,
    stop_after_kv: bool,
    moe: MoeShape | None = None,
    routing: Routing = None,
    local_load: Routing = None,
) -> dict[str, dict[str, int]]:
    """Products of one forward over sequences/spans `lens` = [(n, past)], backward rules applied.

    `stop_after_kv`: the pass ends at the last layer's K/V (span.py's recompute / no-logits
    path): the last layer's attention, MLP, final norm and vocab projection do not run.
    `moe`/`routing`: MoE layers and their per-expert token counts (see `train_flops`).
    `local_load`: per MoE layer, the tokens each of this rank's experts processes, when they
    are not this pass's own tokens (an expert-parallel rank: `ep_rank_flops`).
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if any(n < 0 or p < 0 for n, p in lens):
        raise ValueError(f"sequence lengths must be >= 0, got {list(lens)}")
    if lora is not None and frozen is not None:
        raise ValueError("pass `frozen` or `lora`, not both: LoRA freezes every base parameter")
    w = _Pass((lambda name: False) if lora else _trainable_fn(frozen), lora)
    tokens = sum(n for n, _ in lens)
    moe_rows = _moe_rows(spec, moe, routing, lora, tokens, stop_after_kv)
    if local_load is not None:
        moe_rows = dict(zip(moe_rows, local_load))
    pairs = sum(_pairs(n, p, attention) for n, p in lens)
    has_past = any(p for _, p in lens)
    h, hd = spec.hidden, spec.head_dim
    emb = "embedding.word_embeddings.weight"
    x_rg = w.trainable(emb)  # embedding lookup: no FLOPs, but its grad makes x require grad
    for i in range(spec.layers):
        p = f"decoder.layers.{i}."
        a = p + "self_attention."
        ln_rg = x_rg or w.trainable(p + "input_layernorm.weight")
        kv = spec.kv_heads * hd
        outs = {"q_proj": spec.heads * hd, "k_proj": kv, "v_proj": kv}
        base_rg = w.linear({"qkv_proj": 2 * tokens * h * sum(outs.values())}, ln_rg,
                           a + "linear_qkv.weight")
        base_rg = base_rg or (spec.qkv_bias and w.trainable(a + "linear_qkv.bias"))
        w.adapter("qkv_proj", tokens, h, [o for t, o in outs.items() if w.targeted(t)], ln_rg)
        rg = {t: base_rg or w.targeted(t) for t in outs}
        if not (lora and lora.separate_qkv):  # one fused output: any adapter makes it require grad
            rg = dict.fromkeys(outs, any(rg.values()))
        if stop_after_kv and i == spec.layers - 1:
            return w.comps
        q_rg = rg["q_proj"] or (spec.qk_norm and w.trainable(a + "q_layernorm.weight"))
        k_rg = rg["k_proj"] or (spec.qk_norm and w.trainable(a + "k_layernorm.weight"))
        # why: torch.cat([past.k, k]) requires grad when the context leaves collect adjoints
        ctx_rg = context_grad and has_past
        attn_rg = w.attention(spec, pairs, q_rg, k_rg or ctx_rg, rg["v_proj"] or ctx_rg)
        attn_out = spec.heads * hd
        o_rg = w.linear({"out_proj": 2 * tokens * attn_out * h}, attn_rg, a + "linear_proj.weight")
        w.adapter("out_proj", tokens, attn_out, [h] if w.targeted("o_proj") else [], attn_rg)
        x_rg = x_rg or o_rg or w.targeted("o_proj")
        ln_rg = x_rg or w.trainable(p + "pre_mlp_layernorm.weight")
        if i in moe_rows:
            m_rg = _moe(w, spec, moe, p, tokens, moe_rows[i], ln_rg)
        else:
            m_rg = _mlp(w, spec, p, tokens, ln_rg)
        x_rg = x_rg or m_rg
    fin_rg = x_rg or w.trainable("decoder.final_layernorm.weight")
    out_w = emb if spec.tie else "output_layer.weight"
    w.linear({"vocab_proj": 2 * logits_tokens * h * spec.vocab_size}, fin_rg, out_w)
    return w.comps


def _mlp(w: _Pass, spec: "ModelSpec", p: str, tokens: int, ln_rg: bool) -> bool:
    """Dense SwiGLU MLP: fc1 = [gate; up] (one Megatron weight), fc2 = down."""
    h, ffn = spec.hidden, spec.ffn
    f = 2 * tokens * h * ffn
    fc1_rg = w.linear({"mlp_gate": f, "mlp_up": f}, ln_rg, p + "mlp.linear_fc1.weight")
    # peft's gate_proj/up_proj adapters; megatron stacks their A's into one [2r, H] product
    w.adapter("mlp_gate", tokens, h, [ffn] if w.targeted("gate_proj") else [], ln_rg)
    w.adapter("mlp_up", tokens, h, [ffn] if w.targeted("up_proj") else [], ln_rg)
    # why: silu(gate)·up requires grad if either factor does (fused or not)
    act_rg = fc1_rg or w.targeted("gate_proj") or w.targeted("up_proj")
    down_rg = w.linear({"mlp_down": f}, act_rg, p + "mlp.linear_fc2.weight")
    w.adapter("mlp_down", tokens, ffn, [h] if w.targeted("down_proj") else [], act_rg)
    return down_rg or w.targeted("down_proj")


def _moe_rows(spec: "ModelSpec", moe: MoeShape | None, routing: Routing, lora: LoraShape | None,
              tokens: int, stop_after_kv: bool) -> dict[int, list[int] | None]:
    """MoE layer index -> its per-expert token counts (None: k·T in all, per-expert unknown)."""
    if moe is None:
        if routing is not None:
            raise ValueError("routing given for a model without MoE layers (pass moe=)")
        return {}
    if moe.layers and moe.layers[-1] >= spec.layers:
        raise ValueError(f"MoE layers {moe.layers} beyond the model's {spec.layers} layers")
    if lora is not None and {"gate_proj", "up_proj", "down_proj"} & set(lora.targets):
        raise ValueError("LoRA on MoE expert projections is not counted by the ledger; "
                         "target the attention projections only")
    ran = [i for i in moe.layers if not (stop_after_kv and i == spec.layers - 1)]
    if routing is None:
        return dict.fromkeys(ran)
    return dict(zip(ran, check_routing(moe, routing, ran, tokens)))


def _moe(w: _Pass, spec: "ModelSpec", moe: MoeShape, p: str, tokens: int,
         counts: list[int] | None, ln_rg: bool) -> bool:
    """MoE MLP: router, then each local expert's SwiGLU on the tokens routed to it (`counts`
    by local index j; j = e without expert parallelism). Names: sequential
    `mlp.experts.local_experts.{j}.linear_fc1/2.weight`, TE grouped
    `mlp.experts.linear_fc1/2.weight{j}`; an expert is frozen if either name is."""
    h, ffn = spec.hidden, moe.ffn
    out_rg = w.router(2 * tokens * h * moe.experts, ln_rg, p + "mlp.router.weight")
    if counts is None:  # per-expert split unknown: the k·T routed tokens, if freezing is uniform
        state = {(_expert_trainable(w, p, e, "fc1"), _expert_trainable(w, p, e, "fc2"))
                 for e in range(moe.experts)}
        if len(state) > 1:
            raise ValueError(f"{p}mlp: some experts frozen, some not: pass routing= counts")
        counts = [moe.top_k * tokens]  # one stand-in expert, expert 0's names
    for e, n in enumerate(counts):
        f = 2 * n * h * ffn
        act_rg = w.linear({"expert_gate": f, "expert_up": f}, ln_rg,
                          _expert_trainable(w, p, e, "fc1"))
        down_rg = w.linear({"expert_down": f}, act_rg, _expert_trainable(w, p, e, "fc2"))
        out_rg = out_rg or (n > 0 and down_rg)
    return out_rg


def _expert_trainable(w: _Pass, p: str, e: int, fc: str) -> bool:
    x = p + "mlp.experts."
    return w.trainable(f"{x}local_experts.{e}.linear_{fc}.weight") and w.trainable(
        f"{x}linear_{fc}.weight{e}")


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
    lora: LoraLike = None,
    moe: Any = None,
    routing: Routing = None,
) -> FlopBreakdown:
    """One forward + backward of independent sequences of lengths `seq_lens`.

    Padded batches: pass the padded lengths (padding that reaches a kernel counts).
    `logits_positions`: positions that go through the vocabulary projection (a count, or one
    count per sequence); default every position. `frozen`: Megatron parameter names (local
    spelling, see `frozen_names`) or a predicate on them. `lora`: a LoRA policy (`LoraShape`
    or `model/lora.LoraSpec`): every base parameter frozen, the adapters' own products counted.
    `moe`: the MoE layers (`MoeShape`); default: the spec's MoE fields, every layer.
    `routing`: tokens each MoE layer routed to each expert in this pass, summed over the
    sequences (`RoutingCounter.counts()`); one row per MoE layer, each summing to k·Σ seq_lens.
    """
    lens = [(int(s), 0) for s in seq_lens]
    comps = _walk(
        spec, lens, attention=attention,
        logits_tokens=_logits_tokens(logits_positions, sum(n for n, _ in lens)),
        frozen=frozen, lora=LoraShape.of(lora), context_grad=False, stop_after_kv=False,
        moe=MoeShape.of(moe if moe is not None else spec), routing=routing,
    )  # fmt: skip
    return _breakdown(comps)


def ep_rank_flops(
    spec: "ModelSpec",
    seq_lens: Sequence[Sequence[int]],
    routing: Sequence[Routing],
    ep_rank: int,
    *,
    attention: str = "full",
    logits_positions: int | Sequence[int] | None = None,
    frozen: Frozen = None,
) -> FlopBreakdown:
    """What expert-parallel rank `ep_rank` executes in one forward + backward, with
    `seq_lens[r]` and `routing[r]` the sequences and `RoutingCounter.counts()` of each of the
    EP group's ranks (ep = len(seq_lens)).

    A rank runs attention, router and head on its own tokens, and its block of E/ep experts
    (megatron: e = ep_rank·E/ep + j) on every rank's tokens routed to them (the all-to-all
    brings them). Summed over the ranks it is the model FLOPs of all their sequences.
    `logits_positions`, `frozen`: of this rank (its local expert names).
    """
    moe, ep = MoeShape.of(spec), len(seq_lens)
    if moe is None or len(routing) != ep or not 0 <= ep_rank < ep or moe.experts % ep:
        raise ValueError(f"ep_rank_flops needs a MoE spec, one routing per EP rank and "
                         f"experts divisible by ep={ep} (ep_rank {ep_rank})")
    for r in range(ep):  # each rank's own routing is checked against its own tokens
        check_routing(moe, routing[r], moe.layers, sum(seq_lens[r]))
    block = moe.experts // ep
    lo = ep_rank * block
    load = [[sum(routing[r][i][lo + j] for r in range(ep)) for j in range(block)]
            for i in range(len(moe.layers))]
    lens = [(int(s), 0) for s in seq_lens[ep_rank]]
    comps = _walk(
        spec, lens, attention=attention,
        logits_tokens=_logits_tokens(logits_positions, sum(n for n, _ in lens)),
        frozen=frozen, lora=None, context_grad=False, stop_after_kv=False,
        moe=moe, local_load=load,
    )  # fmt: skip
    return _breakdown(comps)


def forward_flops(
    spec: "ModelSpec",
    seq_lens: Sequence[int],
    *,
    attention: str = "full",
    logits_positions: int | Sequence[int] | None = None,
    moe: Any = None,
    routing: Routing = None,
) -> int:
    """Forward FLOPs of independent sequences of lengths `seq_lens`."""
    return train_flops(
        spec, seq_lens, attention=attention, logits_positions=logits_positions, moe=moe,
        routing=routing,
    ).forward


def span_flops(
    spec: "ModelSpec",
    n: int,
    context: int,
    *,
    attention: str = "full",
    logits_positions: int | None = None,
    frozen: Frozen = None,
    lora: LoraLike = None,
    context_grad: bool = True,
    moe: Any = None,
    routing: Routing = None,
) -> FlopBreakdown:
    """Forward + backward of a span of `n` tokens attending to `context` earlier tokens' K/V.

    An OPD turn or a shared-prefix continuation (`model/span.py`): weight products on n tokens,
    QK^T/AV on n×(context+n) pairs (full) or n·context + n(n+1)/2 (causal).
    `context_grad`: the context K/V are leaves collecting adjoints (the default in this
    project), so their grads are computed. `logits_positions=0`: the span stops after the
    last layer's K/V (`span_forward(want_logits=False)`, e.g. a shared prompt).
    `moe`/`routing`: as in `train_flops`, for the span's n tokens (no row for a last MoE
    layer the span does not run).
    """
    stop = logits_positions == 0
    comps = _walk(
        spec, [(int(n), int(context))], attention=attention,
        logits_tokens=_logits_tokens(logits_positions, int(n)),
        frozen=frozen, lora=LoraShape.of(lora), context_grad=context_grad, stop_after_kv=stop,
        moe=MoeShape.of(moe if moe is not None else spec), routing=routing,
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
    lora: LoraLike = None,
    moe: Any = None,
    routing: Routing = None,
) -> FlopBreakdown:
    """Deferred OPD replay of one earlier turn: adjoints on its K/V pushed back through it.

    The replayed graph ends at the last layer's K/V. `mode="recompute"` rebuilds it first:
    that forward goes to `recompute_flops` (not credited); `"retain"` reuses the kept graph.
    The replay backward is real gradient work and is credited as backward.
    `moe`/`routing`: as in `span_flops` with `logits_positions=0`.
    """
    if mode not in ("recompute", "retain"):
        raise ValueError(f"mode must be 'recompute' or 'retain', got {mode!r}")
    comps = _walk(
        spec, [(int(n), int(context))], attention=attention, logits_tokens=0,
        frozen=frozen, lora=LoraShape.of(lora), context_grad=True, stop_after_kv=True,
        moe=MoeShape.of(moe if moe is not None else spec), routing=routing,
    )  # fmt: skip
    out = _breakdown(comps, recompute=True)
    if mode == "retain":
        return FlopBreakdown(0, out.backward, 0, {
            k: {**v, "recompute": 0} for k, v in out.by_component.items()
        })  # fmt: skip
    return out
