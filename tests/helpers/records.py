"""Hand-made trace records: the fields a test does not look at filled in."""

from __future__ import annotations

from tsync_mcore.observability.trace import DeferredRecord, SourceRecord, UpdateRecord


def source(**kw) -> SourceRecord:
    """A GRPO trajectory, or an OPD turn when `turn` is given; on-policy."""
    turn = kw.get("turn")
    base = dict(update=0, rank=0, source="trajectory" if turn is None else "turn",
                traj_id="t", group_id="g", turn=None, policy_version=kw.get("update", 0),
                scored_tokens=1, ready=0.0)
    if kw.get("start") is not None:
        base.update(cpu=kw["end"] - kw["start"], span_tokens=1, logits=True)
    return SourceRecord(**(base | kw))


def deferred(**kw) -> DeferredRecord:
    """An OPD replay by default."""
    base = dict(update=0, rank=0, work="replay", group_id="g", traj_id="t", ready=0.0,
                start=0.0, end=0.0, cpu=0.0, replay_mode="recompute")
    return DeferredRecord(**(base | kw))


def update(**kw) -> UpdateRecord:
    base = dict(update=0, rank=0, objective="grpo", schedule="thundersync", n_groups=1,
                n_sources=1, scored_tokens=1)
    return UpdateRecord(**(base | kw))
