"""When a source may be served: release rules and the admission cap (SPEC §3).

The three schedules run the same learner work and differ only in release time:
  sync         every source is released when the whole batch closes,
  group_ready  a group's sources are released when its last reward is known,
  thundersync  each source is released the moment it arrives.
The queue is work-conserving and serves released sources in readiness order, skipping
(not waiting behind) a source whose group would exceed the `k_open` cap of groups holding
G1'/G2 on this rank. A source served once its group is complete (every reward known, the
one that completes it included) needs no pair: its advantage is known, so it folds
straight into the batch accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tsync_mcore.sources import BatchPlan, TrajectorySource

Fold = Literal["direct", "pair"]
SCHEDULES = ("sync", "group_ready", "thundersync")


@dataclass(frozen=True)
class Service:
    group_id: str
    source: TrajectorySource | None  # None: only close the group's pair
    fold: Fold  # "direct": A_i known; "pair": fold into the group's G1'/G2
    closes_group: bool  # the group's pair is combined after this (its rewards are all known)
    last_here: bool  # nothing more of this group will be served on this rank


class ReadinessQueue:
    """One rank's queue. A group is *complete* once every member's reward is known here:
    all its members arrived (static routing), or the rollout announced the rewards of
    members that went to other ranks (balanced routing). Only then is A_i known."""

    def __init__(self, schedule: str, plan: BatchPlan, k_open: int):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}")
        self.schedule = schedule
        self.plan = plan
        self.k_open = k_open
        self._complete: set[str] = set()
        self._pending: dict[str, int] = {}  # arrived here, not yet served
        self._open: set[str] = set()
        self._closable: list[str] = []  # complete, pair open, nothing of it left to serve
        self._released: list[TrajectorySource] = []
        self._held: list[TrajectorySource] = []  # arrived, not yet released

    @property
    def open_groups(self) -> int:
        return len(self._open)

    def arrive(self, src: TrajectorySource) -> None:
        g = src.group_id
        self._pending[g] = self._pending.get(g, 0) + 1
        if self.schedule == "thundersync" or (self.schedule == "group_ready" and g in self._complete):
            self._released.append(src)
        else:
            self._held.append(src)

    def complete(self, g: str) -> None:
        """Every reward of group g is known: group_ready releases its members here."""
        self._complete.add(g)
        if self.schedule == "group_ready":
            self._released += [s for s in self._held if s.group_id == g]
            self._held = [s for s in self._held if s.group_id != g]
        if g in self._open and not self._pending.get(g):
            self._closable.append(g)

    def is_complete(self, g: str) -> bool:
        return g in self._complete

    def close(self) -> None:
        """The batch is closed (every source has arrived): release whatever is held."""
        if self.schedule == "sync":
            # Synchronous training walks the batch in its registered order.
            rank = {t: i for i, t in enumerate(t for ts in self.plan.groups.values() for t in ts)}
            self._held.sort(key=lambda s: rank[s.traj_id])
        self._released += self._held
        self._held = []

    def pending(self) -> int:
        return len(self._released) + len(self._held) + len(self._closable)

    def next(self) -> Service | None:
        """The next piece of work that may run now, or None."""
        if self._closable:
            g = self._closable.pop(0)
            self._open.discard(g)
            return Service(g, None, "pair", closes_group=True, last_here=True)
        for i, src in enumerate(self._released):
            g = src.group_id
            if g in self._complete:
                fold: Fold = "direct"
            elif g in self._open:
                fold = "pair"
            elif len(self._open) < self.k_open:
                fold = "pair"
                self._open.add(g)
            else:
                continue  # would exceed k_open; a later source may still be admissible
            del self._released[i]
            self._pending[g] -= 1
            last = g in self._complete and self._pending[g] == 0
            closes = last and g in self._open
            if closes:
                self._open.discard(g)
            return Service(g, src, fold, closes_group=closes, last_here=last)
        return None
