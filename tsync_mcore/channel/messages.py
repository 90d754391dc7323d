"""The messages that travel between the rollout process and the learner ranks.

Direction is part of the protocol (`ROLLOUT_SENDS`, `LEARNER_SENDS`); a link rejects a
message that comes from the wrong side. Content (vocabulary, versions, duplicates, group
membership) is the learner's to validate through `tsync_mcore.sources`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tsync_mcore.sources import TrajectorySource, TurnSource


@dataclass(frozen=True)
class Hello:
    """Learner rank 0 → rollout at start: the policy version and data position to resume at."""

    version: int
    data_pos: int


@dataclass(frozen=True)
class RegisterBatch:
    """Rollout → every learner rank: the groups of update `version` (before any source)."""

    version: int
    objective: str
    groups: dict[str, list[str]] = field(default_factory=dict)
    n_turns: dict[str, int] = field(default_factory=dict)  # OPD: trajectory id → turn count
    data_pos: int = 0  # data position after this batch (what a resume would start from)
    # Release schedule for this batch only (None: the learner's configured one). Lets a
    # benchmark alternate schedules batch by batch in one run, so machine drift is paired.
    schedule: str | None = None
    # How sources reach the ranks (tsync_mcore.routing): "static" (group → owner) or
    # "balanced" (trajectory → least-loaded rank, with GroupRewards announcements).
    routing: str = "static"


@dataclass(frozen=True)
class TrajectoryMsg:
    """Rollout → owner rank: one ready GRPO-family source."""

    source: TrajectorySource


@dataclass(frozen=True)
class TurnMsg:
    """Rollout → owner rank: one ready OPD turn."""

    source: TurnSource


@dataclass(frozen=True)
class GroupRewards:
    """Rollout → the learner ranks holding members of a split GRPO group (balanced routing):
    the group has finished; the rewards of all its members, sent after the last member's
    TrajectoryMsg."""

    version: int
    group_id: str
    rewards: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CloseBatch:
    """Rollout → every learner rank: update `version` has all its sources (n_sources overall)."""

    version: int
    rollout_time_s: float
    n_sources: int
    reward_mean: float | None = None  # over the batch's trajectories (None: none; NaN on the wire)


@dataclass(frozen=True)
class Publish:
    """Learner rank 0 → rollout: weights θ_version are at `path`."""

    version: int
    path: str


@dataclass(frozen=True)
class Ack:
    """Rollout → learner rank 0: the engines reloaded θ_version (or why not)."""

    version: int
    ok: bool
    error: str = ""
    reload_time_s: float = 0.0


@dataclass(frozen=True)
class Shutdown:
    """Either direction: the link ends; the receiver replies with its own Shutdown."""

    reason: str = ""


Message = (Hello | RegisterBatch | TrajectoryMsg | TurnMsg | GroupRewards | CloseBatch | Publish
           | Ack | Shutdown)

ROLLOUT_SENDS: tuple[type, ...] = (RegisterBatch, TrajectoryMsg, TurnMsg, GroupRewards, CloseBatch,
                                   Ack, Shutdown)
LEARNER_SENDS: tuple[type, ...] = (Hello, Publish, Shutdown)
