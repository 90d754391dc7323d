"""The asynchronous schedules' rollout-side rules, free of engines and channels.

- `span_off_policy`: what a source carries about how it was sampled (behaviour log-probs
  per token, per-token versions when it spans several, its oldest version).
- `may_start`: AReaL's staleness control (its StalenessManager: capacity =
  (max_head_offpolicyness + version + 1) · batch size − (accepted + running)): a new group
  starts only while it cannot end up more than `max_staleness` versions behind.
- `BatchFormer`: fully_async batches from completed groups, in completion order; a group
  too stale for the batch it would join is dropped (counted, never sent).
docs/design/async.md describes the protocol these serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def span_off_policy(logprobs: Sequence[float | None], versions: Sequence[int | None],
                    mask: Sequence[int], start: int, end: int, default: int
                    ) -> tuple[tuple[float | None, ...], tuple[int, ...], int]:
    """(behaviour_logprobs, token_versions, policy_version) of tokens[start:end].

    Log-probs are kept at scored tokens only (None elsewhere). policy_version is the oldest
    version among the span's scored tokens (`default` when it has none); token_versions is
    () unless the scored tokens span several versions, and then gives every unscored token
    policy_version (it was not sampled: no version of its own).
    """
    lps = tuple(lp if mask[i] else None for i, lp in zip(range(start, end), logprobs[start:end]))
    scored = [versions[i] for i in range(start, end) if mask[i]]
    if any(v is None for v in scored):
        raise ValueError("span_off_policy: a scored token has no version")
    oldest = min(scored) if scored else default
    if len(set(scored)) <= 1:
        return lps, (), oldest
    vs = tuple(versions[i] if mask[i] else oldest for i in range(start, end))
    return lps, vs, oldest


def may_start(live_groups: int, loaded: int, v0: int, max_staleness: int,
              groups_per_batch: int) -> bool:
    """True while one more group may start: groups started and not dropped stay below
    (loaded − v0 + max_staleness + 1) · groups_per_batch. Batch k needs the groups of
    batches v0..k; a group started under `loaded` then joins a batch ≤ loaded +
    max_staleness, so its lag stays within the bound unless it finishes late."""
    return live_groups < (loaded - v0 + max_staleness + 1) * groups_per_batch


@dataclass
class Group:
    """A completed group: its id, data position, members' sources (any payload) and the
    oldest version of any scored token among them."""

    group_id: str
    pos: int
    members: list
    oldest: int


@dataclass
class BatchFormer:
    """Completed groups wait here, in completion order, for the next batch."""

    groups_per_batch: int
    max_staleness: int
    ready: list[Group] = field(default_factory=list)
    dropped: int = 0  # groups dropped too stale, over the run

    def add(self, group: Group) -> None:
        self.ready.append(group)

    def take(self, version: int) -> tuple[list[Group], list[Group]]:
        """(the groups of batch `version`, or [] while fewer than a batch are ready; the
        groups dropped now for a lag above max_staleness at this registration)."""
        floor = version - self.max_staleness
        stale = [g for g in self.ready if g.oldest < floor]
        self.ready = [g for g in self.ready if g.oldest >= floor]
        self.dropped += len(stale)
        if len(self.ready) < self.groups_per_batch:
            return [], stale
        batch, self.ready = (self.ready[:self.groups_per_batch],
                             self.ready[self.groups_per_batch:])
        return batch, stale
