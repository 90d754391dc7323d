"""One batch's state, from `Learner.begin` to its step (learner/update.py).

Everything that lives for one batch is here, in one `BatchState` that `begin()` makes and
the step drops: the plan, the release queue, what arrived and was served, the trace, the
batch's figures. The learner's parts (policy, accumulators, serving kind, regularisers)
outlive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tsync_mcore.channel.sources import BatchPlan
from tsync_mcore.learner.minibatch import MiniBatches
from tsync_mcore.learner.schedule import ReadinessQueue
from tsync_mcore.observability.trace import Record, SourceRecord


@dataclass
class BatchState:
    plan: BatchPlan
    schedule: str  # the release schedule of this batch (learner.schedule, or the registration's)
    routing: str  # how sources reach the DP ranks: "static" or "balanced"
    max_lag: int  # how many updates behind θ_k a source may have been sampled
    owner: dict[str, int]  # group → the DP rank that serves it (static routing)
    member_of: dict[str, str]  # trajectory → its group
    t0: float  # perf_counter origin of the trace's times
    kl: torch.Tensor  # Σ of the KL estimator over the scored tokens served with it (device)
    queue: ReadinessQueue | None = None  # set by begin once the mini-batch split is known
    # learner.minibatches > 1: the later mini-batches (learner/minibatch.py); None: one step
    mb: MiniBatches | None = None
    kl_tokens: int = 0
    arrived: dict[str, object] = field(default_factory=dict)  # by unit key, served here or not
    records: dict[str, SourceRecord] = field(default_factory=dict)  # units given to this rank
    trace: list[Record] = field(default_factory=list)
    scored: dict[str, int] = field(default_factory=dict)  # scored tokens served here, per group
    lag_sums: dict[str, int] = field(default_factory=dict)  # Σ k − v over them, per unit
    dropped: dict[str, str] = field(default_factory=dict)  # group → why it left the update
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (source, why), refused here
    nonfinite: list[str] = field(default_factory=list)  # check_finite=source: the culprit
    open_peak_bytes: int = 0
    pairs_held: int = 0  # times this batch waited to pack instead of a pair pass
    passes: int = 0  # packed passes run (SourceRecord.pass_id)
    dummy_passes: int = 0  # ep > 1: passes run only to match other ranks' (no work)
    unfolded: bool = False  # the grad buffers hold gradient already in the batch (fold_later)
    minibatch_tokens: list[int] = field(default_factory=list)  # scored, mini-batches 2..m


def lag(src, version: int) -> tuple[int, int]:
    """(Σ of k − v over a source's scored tokens, its scored tokens sampled by a version < k)
    for θ_k = `version`."""
    if src.token_versions:
        lags = [version - v for m, v in zip(src.scored_mask, src.token_versions) if m]
        return sum(lags), sum(1 for x in lags if x > 0)
    k = version - src.policy_version
    return k * src.n_scored, src.n_scored if k > 0 else 0
