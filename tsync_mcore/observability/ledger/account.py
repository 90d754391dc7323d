"""Learner FLOPs of one update from what its trace says actually ran.

Every record of served work carries the span it executed (tsync_mcore.observability.trace): a source's
`span_tokens` after `context` tokens of K/V (a whole trajectory, a continuation after a
shared prompt, an OPD turn), and deferred work's `spans`: a shared prompt's backward at
group close (forward to the last K/V and backward, no logits) and OPD replays (pushed back
through, recomputed or retained). The KL term's reference model forwards a source's
`reference_tokens` (forward FLOPs only; with LoRA the base alone, adapters off), and PPO's
old log-probs `old_logprob_tokens` (forward only).
Recomputation is reported separately and not credited:
OPD context recompute, and the fused LM head's recompute of the scored positions' logits
in its backward (a source with `fused_head` projects only those positions to the vocabulary).
"""

from __future__ import annotations

from typing import Iterable

from tsync_mcore.observability.ledger.flops import (FlopBreakdown, head_recompute_flops, replay_flops,
                                      span_flops)
from tsync_mcore.observability.trace import DeferredRecord, Record, SourceRecord


def update_flops(spec, records: Iterable[Record], attention: str = "full",
                 lora=None, moe=None) -> FlopBreakdown:
    """`attention`: 'full' (megatron DotProductAttention) or 'causal' (SDPA / TE kernels);
    `lora`: the policy's LoRA (`Policy.lora`, a `LoraSpec`), None for full weights; `moe`:
    the MoE layers (`MoeShape`, default: the spec's). MoE experts are counted on k·T routed
    tokens per span (exact for dropless routing; no per-record routing is traced)."""
    a = attention
    total = FlopBreakdown(0, 0, 0, {})
    for r in records:
        if isinstance(r, DeferredRecord) and r.work == "replay":
            for n, ctx in r.spans:
                total = total + replay_flops(spec, n, ctx, mode=r.replay_mode or "recompute",
                                             attention=a, lora=lora, moe=moe)
        elif isinstance(r, DeferredRecord) and r.work == "old_logprob":
            continue  # counted with its source (SourceRecord.old_logprob_tokens)
        elif isinstance(r, DeferredRecord):  # prefix
            for n, ctx in r.spans:
                total = total + span_flops(spec, n, ctx, logits_positions=0, attention=a,
                                           lora=lora, moe=moe)
        elif isinstance(r, SourceRecord) and r.span_tokens:
            if not r.logits:
                # An OPD turn without scored tokens: forward to its K/V only; its backward
                # happens in its trajectory's replay.
                f = span_flops(spec, r.span_tokens, r.context, logits_positions=0, attention=a,
                               lora=lora, moe=moe)
                total = total + FlopBreakdown(f.forward, 0, 0, {
                    k: {**v, "backward": 0} for k, v in f.by_component.items()})
                continue
            head = r.scored_tokens if r.fused_head and r.scored_tokens else None
            # the KL term's reference, PPO's old log-probs: forwards without a backward
            for n, lo in ((r.reference_tokens, None), (r.old_logprob_tokens, lora)):
                if n:
                    f = span_flops(spec, n, 0, logits_positions=head, attention=a, lora=lo,
                                   moe=moe)
                    total = total + FlopBreakdown(f.forward, 0, 0, {
                        k: {**v, "backward": 0} for k, v in f.by_component.items()})
            total = total + span_flops(spec, r.span_tokens, r.context, logits_positions=head,
                                       context_grad=r.context > 0, attention=a, lora=lora, moe=moe)
            if head:
                total = total + head_recompute_flops(spec, head)
    return total
