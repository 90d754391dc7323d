"""The simulated rollout's decisions for the asynchronous schedules (docs/design/async.md), free of
clocks and sockets so that tests can drive them with a fake clock; overlap.py plays them
in real time against the real learner.

one_step_off: batch b is sampled with θ_{max(b−1, v0)} (v0: the version the segment started
at), so its rollout may start once batch b−1 has closed and θ_{b−1} is loaded — the learner
trains batch b−1 meanwhile (verl's one-step-off-policy recipe, slime's --async mode).

fully_async: groups are generated continuously with up to a batch worth in flight; a new
group starts only while groups started < (loaded − v0 + max_staleness + 1) · groups per
batch (AReaL's staleness control, areal/core/staleness_manager.py). A batch is the next
`groups per batch` completed groups in completion order; a group older than max_staleness
at registration is dropped and counted, never sent. Simplification of the simulator: a
group is sampled entirely by the version loaded when it started (the real rollout swaps
weights mid-request and records it per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def one_step_off_sampler(batch: int, v0: int) -> int:
    """The policy version that samples batch `batch` of a one_step_off run started at v0."""
    return max(batch - 1, v0)


@dataclass
class StreamGroup:
    index: int  # place in the stream (0, 1, …); the draw's group index is index mod groups
    version: int  # the policy loaded when it started
    start: float
    end: float


@dataclass
class FullyAsyncStream:
    """The fully_async rollout's state: which groups run, which completed, which batch next.

    `duration(i)`: how long group i of the stream takes (its last member's completion
    after its start). Drive it with `start_groups(now)`, `complete_until(now)`,
    `load(version)` and `take_batch()`."""

    groups_per_batch: int
    max_staleness: int
    v0: int
    duration: object  # Callable[[int], float]
    loaded: int = -1
    started: int = 0
    running: list[StreamGroup] = field(default_factory=list)
    completed: list[StreamGroup] = field(default_factory=list)
    next_batch: int = -1
    dropped_stale: int = 0

    def __post_init__(self) -> None:
        if self.loaded < 0:
            self.loaded = self.v0
        if self.next_batch < 0:
            self.next_batch = self.v0

    def allowed(self) -> int:
        """Groups that may have started by now under the staleness bound."""
        return (self.loaded - self.v0 + self.max_staleness + 1) * self.groups_per_batch

    def start_groups(self, now: float) -> list[StreamGroup]:
        """Start groups while a slot is free (a batch worth in flight) and the bound allows."""
        new = []
        while len(self.running) < self.groups_per_batch and self.started < self.allowed():
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
        self.completed += done
        return done

    def load(self, version: int) -> None:
        """A publication reloaded (in flight): later groups start with it."""
        if version < self.loaded:
            raise ValueError(f"publication of version {version} after {self.loaded}")
        self.loaded = version

    def take_batch(self) -> list[StreamGroup] | None:
        """The next batch's groups (completion order), or None while too few completed.
        Groups too old for this batch are dropped here (counted in dropped_stale)."""
        k = self.next_batch
        fresh = [g for g in self.completed if k - g.version <= self.max_staleness]
        self.dropped_stale += len(self.completed) - len(fresh)
        self.completed = fresh
        if len(fresh) < self.groups_per_batch:
            return None
        batch, self.completed = fresh[:self.groups_per_batch], fresh[self.groups_per_batch:]
        self.next_batch += 1
        return batch
