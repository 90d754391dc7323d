"""The messages that travel between the rollout process and the learner ranks.

Each one declares its wire format here, once: the type code, the side that sends it, and
each field's wire kind (`tsync_mcore.channel.schema`). Adding a field is one line (and a
WIRE_VERSION bump); docs/design/wire.md shows the resulting layout (`python -m tsync_mcore.channel
--table`). A link rejects a type that comes from the wrong side. Content (vocabulary,
versions, duplicates, group membership) is the learner's to validate through
`tsync_mcore.channel.sources`.
"""

from __future__ import annotations

import typing

from tsync_mcore.channel.schema import (
    BOOL, EITHER, F64, FLOAT_MAP, I64, LEARNER, MASK, OPT_F64, OPT_F64S, OPT_I64, ROLLOUT, ROUTED,
    STR,
    TOKENS, VERSION, Json, Nested, Str, declared_messages, message, on_wire,
)
from tsync_mcore.channel.routing import ROUTINGS

PUBLISH_METHODS = ("file", "dist", "adapter")
from tsync_mcore.channel.sources import SCHEDULES, TrajectorySource, TurnSource


def _str_lists(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(g, str) and isinstance(ts, (list, tuple)) and all(isinstance(t, str) for t in ts)
        for g, ts in v.items())


def _int_map(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool)
        for k, n in v.items())


def _metric_map(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str)
        and (x is None or isinstance(x, (int, float)) and not isinstance(x, bool))
        for k, x in v.items())


GROUPS = Json(_str_lists, "map str group ids to lists of str trajectory ids")
TURN_COUNTS = Json(_int_map, "map str trajectory ids to int turn counts")
METRICS = Json(_metric_map, "map str metric names to numbers or null")


@message(code=1, sender=LEARNER)
class Hello:
    """Learner rank 0 → rollout at start: the policy version and data position to resume at."""

    version: int = on_wire(VERSION)
    data_pos: int = on_wire(I64)


@message(code=2, sender=ROLLOUT)
class RegisterBatch:
    """Rollout → every learner rank: the groups of update `version` (before any source)."""

    version: int = on_wire(VERSION)
    objective: str = on_wire(Str(nonempty=True))  # its value is the learner's to check
    groups: dict[str, list[str]] = on_wire(GROUPS, default_factory=dict)
    n_turns: dict[str, int] = on_wire(TURN_COUNTS, default_factory=dict)  # OPD: traj → turns
    data_pos: int = on_wire(I64, default=0)  # data position after this batch (a resume's start)
    # Release schedule for this batch only (None: the learner's configured one). Lets a
    # benchmark alternate schedules batch by batch in one run, so machine drift is paired.
    schedule: str | None = on_wire(Str(choices=SCHEDULES, optional=True), default=None)
    # How sources reach the ranks (tsync_mcore.channel.routing): "static" (group → owner) or
    # "balanced" (trajectory → least-loaded rank, with GroupRewards announcements).
    routing: str = on_wire(Str(choices=ROUTINGS), default="static")


@message(code=3, sender=ROLLOUT)
class TrajectoryMsg:
    """Rollout → serving rank: one ready GRPO-family source."""

    source: TrajectorySource = on_wire(Nested(
        TrajectorySource,
        traj_id=STR,
        group_id=STR,
        tokens=TOKENS,
        scored_mask=MASK,
        reward=F64,  # NaN travels: finiteness is the learner's check
        policy_version=VERSION,
        ready_order=I64,
        prompt_len=OPT_I64,
        behaviour_logprobs=OPT_F64S,  # () when the rollout sent none
        token_versions=TOKENS,  # (): every token sampled by policy_version
        routed_experts=ROUTED,  # MoE routing replay; None when the rollout sent none
        segment=I64,  # a trajectory cut by history rewrites: this segment's index
        n_segments=I64,  # 1: the trajectory is one sequence
        trajectory_scored=OPT_I64,  # scored tokens over all its segments (None: one)
    ))


@message(code=4, sender=ROLLOUT)
class TurnMsg:
    """Rollout → owner rank: one ready OPD turn."""

    source: TurnSource = on_wire(Nested(
        TurnSource,
        traj_id=STR,
        group_id=STR,
        turn=I64,
        n_turns=I64,
        start=I64,
        tokens=TOKENS,
        scored_mask=MASK,
        teacher_logprobs=OPT_F64S,  # None where unscored
        policy_version=VERSION,
        ready_order=I64,
        prompt_len=OPT_I64,
        behaviour_logprobs=OPT_F64S,
        token_versions=TOKENS,
        routed_experts=ROUTED,
    ))


@message(code=5, sender=ROLLOUT)
class CloseBatch:
    """Rollout → every learner rank: update `version` has all its sources (n_sources overall)."""

    version: int = on_wire(VERSION)
    rollout_time_s: float = on_wire(F64)
    n_sources: int = on_wire(I64)
    reward_mean: float | None = on_wire(OPT_F64, default=None)  # over the batch (None: none)
    # Rollout-side metrics for the learner's metrics line: reward extras' means, reward
    # errors, evaluation results (names like "reward/errors", "eval/pass@1")
    metrics: dict[str, float | None] = on_wire(METRICS, default_factory=dict)


@message(code=6, sender=LEARNER)
class Publish:
    """Learner rank 0 → rollout: weights θ_version are at `path` (method "file"), or
    follow over the publication group in `n_buckets` buckets (method "dist"; `delta`:
    buckets may carry only what changed, docs/design/publication.md), or θ_version's LoRA adapter
    is the PEFT directory `path` (method "adapter", docs/guide/lora.md)."""

    version: int = on_wire(VERSION)
    path: str = on_wire(STR)
    method: str = on_wire(Str(choices=PUBLISH_METHODS), default="file")
    n_buckets: int = on_wire(I64, default=0)
    delta: bool = on_wire(BOOL, default=False)


@message(code=7, sender=ROLLOUT)
class Ack:
    """Rollout → learner rank 0: the engines reloaded θ_version (or why not)."""

    version: int = on_wire(VERSION)
    ok: bool = on_wire(BOOL)
    error: str = on_wire(STR, default="")
    reload_time_s: float = on_wire(F64, default=0.0)
    # delta publications: the checksum of the weights each rollout worker now holds,
    # comma-separated (publication.dist.fold_checksums); rank 0 compares it to its own
    checksum: str = on_wire(STR, default="")
    bytes_received: int = on_wire(I64, default=0)  # dist: what worker 0 received


@message(code=8, sender=EITHER)
class Shutdown:
    """Either direction: the link ends; the receiver replies with its own Shutdown."""

    reason: str = on_wire(STR, default="")


@message(code=9, sender=ROLLOUT)
class GroupRewards:
    """Rollout → the learner ranks holding members of a split GRPO group (balanced routing):
    the group has finished; the rewards of all its members, sent after the last member's
    TrajectoryMsg."""

    version: int = on_wire(VERSION)
    group_id: str = on_wire(STR)
    rewards: dict[str, float] = on_wire(FLOAT_MAP, default_factory=dict)  # traj id → reward


@message(code=10, sender=LEARNER)
class Rejected:
    """Learner rank → rollout: this rank rejected `source` of group `group_id` in update
    `version`; the rollout drops the group."""

    version: int = on_wire(VERSION)
    group_id: str = on_wire(STR)
    source: str = on_wire(STR)  # the trajectory id, or "traj_id#turn" for an OPD turn
    reason: str = on_wire(STR)


@message(code=11, sender=ROLLOUT)
class DropGroup:
    """Rollout → every learner rank: group `group_id` is dropped from update `version`."""

    version: int = on_wire(VERSION)
    group_id: str = on_wire(STR)
    reason: str = on_wire(STR)


@message(code=12, sender=ROLLOUT)
class PublishGroup:
    """Rollout → learner rank 0 after its Hello (publish.method: dist): join the publication
    group as rank 0 through the store at channel.addr:`port`, `world` members in all,
    named `token` in the store."""

    port: int = on_wire(I64)
    world: int = on_wire(I64)
    token: str = on_wire(Str(nonempty=True))
    backend: str = on_wire(Str(choices=("gloo", "nccl")))


Message = (Hello | RegisterBatch | TrajectoryMsg | TurnMsg | GroupRewards | CloseBatch | Publish
           | Ack | Shutdown | Rejected | DropGroup | PublishGroup)
MESSAGES: tuple[type, ...] = declared_messages()
assert set(typing.get_args(Message)) == set(MESSAGES), "Message must list every message"

ROLLOUT_SENDS: tuple[type, ...] = tuple(m for m in MESSAGES if m.WIRE.sender in (ROLLOUT, EITHER))
LEARNER_SENDS: tuple[type, ...] = tuple(m for m in MESSAGES if m.WIRE.sender in (LEARNER, EITHER))
