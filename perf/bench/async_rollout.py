"""The simulated rollout's decisions for the asynchronous schedules (docs/design/async.md), free of
clocks and sockets so that tests can drive them with a fake clock; simulator.py plays them
in real time against the real learner.

one_step_off: batch b is sampled with θ_{max(b−1, v0)} (v0: the version the segment started
at), so its rollout may start once batch b−1 has closed and θ_{b−1} is loaded — the learner
trains batch b−1 meanwhile (verl's one-step-off-policy recipe, slime's --async mode).

fully_async: groups are generated continuously with up to a batch worth in flight, paced
by the rollout's own rule (tsync_mcore.rollout.pacing, which the rollout driver runs): a new
group starts only while the groups started stay below (loaded − v0 + max_staleness + 1) ·
groups per batch (`may_start`, AReaL's staleness control), and a batch
is the next `groups per batch` completed groups in completion order, a group older than
max_staleness at registration dropped and counted, never sent (`BatchFormer`).
Simplification of the simulator: a group is sampled entirely by the version loaded when it
started (the real rollout swaps weights mid-request and records it per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tsync_mcore.rollout.pacing import BatchFormer, may_start


def one_step_off_sampler(batch: int, v0: int) -> int:
    """The policy version that samples batch `batch` of a one_step_off run started at v0."""
    return max(batch - 1, v0)


@dataclass
class StreamGroup:
    index: int  # place in the stream (0, 1, …); the draw's group index is index mod groups
    version: int  # the policy loaded when it started
    start: float
    end: float

    @property
    def oldest(self) -> int:
        """The version that sampled it (what pacing.BatchFormer checks for staleness)."""
        return self.version


@dataclass
class FullyAsyncStream:
    """The fully_async rollout's state: which groups run, which completed, which batch next.

    `duration(i)`: how long group i of the stream takes (its last member's completion
    after its start). Drive it with `start_groups(now)`, `complete_until(now)`,
    `load(version)` and `take_batch()`. Completed groups wait in `former` (the rollout's
    BatchFormer)."""

    groups_per_batch: int
    max_staleness: int
    v0: int
    duration: object  # Callable[[int], float]
    loaded: int = -1
    started: int = 0
    running: list[StreamGroup] = field(default_factory=list)
    next_batch: int = -1
    former: BatchFormer | None = None

    def __post_init__(self) -> None:
        if self.loaded < 0:
            self.loaded = self.v0
        if self.next_batch < 0:
            self.next_batch = self.v0
        if self.former is None:
            self.former = BatchFormer(self.groups_per_batch, self.max_staleness)

    @property
    def completed(self) -> list[StreamGroup]:
        """Completed groups not yet in a batch, in completion order."""
        return self.former.ready

    @property
    def dropped_stale(self) -> int:
        return self.former.dropped

    def start_groups(self, now: float) -> list[StreamGroup]:
        """Start groups while a slot is free (a batch worth in flight) and the bound allows
        (pacing.may_start). Unlike the rollout, which gives a dropped group's slot back
        (it counts groups started and not dropped), the simulator counts every group
        started, as it always has (tests/unit/test_perf_tools.py checks that bound)."""
        new = []
        while len(self.running) < self.groups_per_batch and may_start(
                self.started, self.loaded, self.v0, self.max_staleness,
                self.groups_per_batch):
            g = StreamGroup(self.started, self.loaded, now, now + self.duration(self.started))
            self.running.append(g)
            new.append(g)
            self.started += 1
        return new

    def next_completion(self) -> float | None:
        return min((g.end for g in self.running), default=None)

    def complete_until(self, now: float) -> list[StreamGroup]:
        done = sorted((g for g in self.running if g.end <= now), key=lambda g: (g.end, g.index))
        self.running = [g for g in self.running if g.end > now]
        for g in done:
            self.former.add(g)
        return done

    def load(self, version: int) -> None:
        """A publication reloaded (in flight): later groups start with it."""
        if version < self.loaded:
            raise ValueError(f"publication of version {version} after {self.loaded}")
        self.loaded = version

    def take_batch(self) -> list[StreamGroup] | None:
        """The next batch's groups (completion order), or None while too few completed.
        Groups too old for this batch are dropped here (counted in dropped_stale)."""
        batch, _stale = self.former.take(self.next_batch)
        if not batch:
            return None
        self.next_batch += 1
        return batch
