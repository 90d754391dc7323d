"""Learner FLOPs of one update from what its trace says actually ran.

Each trace entry of served work carries the span it executed (`span_tokens` tokens after
`context` tokens of K/V): a whole trajectory (context 0), a continuation after a shared
prompt, an OPD turn, the prompt itself at group close (`kind: prefix`, forward to the last
K/V and backward), and OPD replays (`spans` pushed back through, recomputed or retained).
Recomputation is reported separately and not credited.
"""

from __future__ import annotations

from tsync_mcore.ledger.flops import FlopBreakdown, replay_flops, span_flops


def update_flops(spec, trace: list[dict], attention: str = "full") -> FlopBreakdown:
    """`attention`: 'full' (megatron DotProductAttention) or 'causal' (SDPA / TE kernels)."""
    a = attention
    total = FlopBreakdown(0, 0, 0, {})
    for e in trace:
        kind = e.get("kind")
        if kind == "replay":
            for n, ctx in e.get("spans", []):
                total = total + replay_flops(spec, n, ctx, mode=e.get("replay_mode", "recompute"),
                                             attention=a)
        elif kind == "prefix":
            total = total + span_flops(spec, e["span_tokens"], 0, logits_positions=0, attention=a)
        elif e.get("span_tokens"):
            if not e.get("logits", True):
                # An OPD turn without scored tokens: forward to its K/V only; its backward
                # happens in its trajectory's replay.
                f = span_flops(spec, e["span_tokens"], e["context"], logits_positions=0, attention=a)
                total = total + FlopBreakdown(f.forward, 0, 0, {})
                continue
            total = total + span_flops(spec, e["span_tokens"], e["context"],
                                       context_grad=e["context"] > 0, attention=a)
    return total
