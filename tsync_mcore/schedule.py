"""When a source may be served: release rules and the admission cap (SPEC §3).

The three schedules run the same learner work and differ only in release time:
  sync         every source is released when the whole batch closes,
  group_ready  a group's sources are released when its last member arrives,
  thundersync  each source is released the moment it arrives.
The queue is work-conserving and serves released sources in readiness order, skipping
(not waiting behind) a source whose group would exceed the `k_open` cap of groups holding
G1'/G2 on this rank. A source whose whole group has arrived needs no pair: its advantage
is known, so it folds straight into the batch accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tsync_mcore.sources import BatchPlan, TrajectorySource

Fold = Literal["direct", "pair"]
SCHEDULES = ("sync", "group_ready", "thundersync")


@dataclass(frozen=True)
class Service:
    source: TrajectorySource
    fold: Fold  # "direct": A_i known; "pair": fold into the group's G1'/G2
    closes_group: bool  # last member of a pair-folded group: combine it after this fold


class ReadinessQueue:
    def __init__(self, schedule: str, plan: BatchPlan, groups: set[str], k_open: int):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}")
        self.schedule = schedule
        self.plan = plan
        self.k_open = k_open
        self._size = {g: len(plan.groups[g]) for g in groups}
        self._arrived: dict[str, int] = {g: 0 for g in groups}
        self._served: dict[str, int] = {g: 0 for g in groups}
        self._open: set[str] = set()
        self._released: list[TrajectorySource] = []
        self._held: list[TrajectorySource] = []  # arrived, not yet released
        self._closed = False

    @property
    def open_groups(self) -> int:
        return len(self._open)

    def arrive(self, src: TrajectorySource) -> None:
        g = src.group_id
        self._arrived[g] += 1
        if self.schedule == "thundersync":
            self._released.append(src)
        elif self.schedule == "group_ready":
            self._held.append(src)
            if self._arrived[g] == self._size[g]:
                self._released += [s for s in self._held if s.group_id == g]
                self._held = [s for s in self._held if s.group_id != g]
        else:
            self._held.append(src)

    def close(self) -> None:
        """The batch is closed (every source has arrived): release whatever is held."""
        self._closed = True
        if self.schedule == "sync":
            # Synchronous training walks the batch in its registered order.
            rank = {t: i for i, t in enumerate(t for ts in self.plan.groups.values() for t in ts)}
            self._held.sort(key=lambda s: rank[s.traj_id])
        self._released += self._held
        self._held = []

    def pending(self) -> int:
        return len(self._released) + len(self._held)

    def next(self) -> Service | None:
        """Pop the first released source that may be served now, or None."""
        for i, src in enumerate(self._released):
            g = src.group_id
            complete = self._arrived[g] == self._size[g]
            if g in self._open:
                fold: Fold = "pair"
            elif complete:
                fold = "direct"
            elif len(self._open) < self.k_open:
                fold = "pair"
                self._open.add(g)
            else:
                continue  # would exceed k_open; a later source may still be admissible
            del self._released[i]
            self._served[g] += 1
            closes = fold == "pair" and self._served[g] == self._size[g]
            if closes:
                self._open.discard(g)
            return Service(src, fold, closes)
        return None
