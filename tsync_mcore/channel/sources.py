"""Learner work items (sources), the batch plan they belong to, and their validation.

A GRPO source is one trajectory: its tokens, the scored-token mask (generated assistant
tokens only) and its reward. It is ready once all three are fixed. Every check here runs
before the learner touches any state, so a rejected source never reaches the accumulators
or the parameters.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# The schedules a run may name (learner/schedule.py implements them); declared here, with the
# source types, because the register message carries the name across the wire.
SYNC_SCHEDULES = ("sync", "group_ready", "thundersync")  # every source sampled by θ_k
ASYNC_SCHEDULES = ("one_step_off", "fully_async")  # sources may lag: off-policy baselines
SCHEDULES = SYNC_SCHEDULES + ASYNC_SCHEDULES


class SourceError(ValueError):
    """A source, or the batch it belongs to, is malformed; the message names it."""


# Bounds on the numbers a source carries, so nothing downstream can overflow: group
# statistics square reward deviations in float64, and OPD turns a teacher log-prob into a
# per-token loss weight in the student's precision. Rewards of RL tasks are O(1); a sampled
# token's teacher log-prob is far above the floor, while a masked logit (−inf, −3.4e38,
# −1e9, fp16's −65504) lands below it: the teacher could not have produced that token.
MAX_ABS_REWARD = 1e6
TEACHER_LOGPROB_FLOOR = -1e4
# Segments one trajectory may be cut into (history rewrites: a template that drops earlier
# turns' reasoning, an agent that compacts its context); each is a release unit of its own.
MAX_SEGMENTS = 256


def check_reward(name: str, r) -> float:
    """The reward as a float, or SourceError unless it is a number with |r| ≤ MAX_ABS_REWARD."""
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) \
            or abs(r) > MAX_ABS_REWARD:
        raise SourceError(f"{name}: reward must be a finite number with |r| ≤ {MAX_ABS_REWARD:g}, "
                          f"got {r!r}")
    return float(r)


def check_length(name: str, end: int, max_tokens: int | None) -> None:
    """A source may not reach past the positions the learner accepts (the model's, or less)."""
    if max_tokens is not None and end > max_tokens:
        raise SourceError(f"{name}: {end} tokens, more than the learner accepts ({max_tokens}: "
                          f"min of the model's positions and learner.max_tokens)")


# --- JSON Lines records: key set and field types, checked before any source is built ---

def _got(v: Any) -> str:
    """A value as the JSON that held it, shortened: messages stay one readable line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        r = repr(v)
        return r if len(r) <= 24 else r[:20] + "..."
    if isinstance(v, str):
        return _short(v)
    return "a list" if isinstance(v, list) else "an object" if isinstance(v, dict) \
        else type(v).__name__


def _short(s: str, n: int = 40) -> str:
    return repr(s) if len(s) <= n else repr(s[:n]) + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a number


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# A field checker returns what is wrong with a value, or None.
Check = Callable[[Any], "str | None"]


def _id(v: Any) -> str | None:
    ok = isinstance(v, str) or _is_int(v)
    return None if ok else f"must be a string or an integer, got {_got(v)}"


def _int(v: Any) -> str | None:
    return None if _is_int(v) else f"must be an integer, got {_got(v)}"


def _int_or_null(v: Any) -> str | None:
    return None if v is None or _is_int(v) else f"must be an integer or null, got {_got(v)}"


def _finite(v: Any) -> str | None:
    return None if _is_num(v) and math.isfinite(v) else f"must be a finite number, got {_got(v)}"


def _list_of(ok: Callable[[Any], bool], what: str) -> Check:
    def check(v: Any) -> str | None:
        if not isinstance(v, list):
            return f"must be a list of {what}, got {_got(v)}"
        bad = next((i for i, x in enumerate(v) if not ok(x)), None)
        return None if bad is None else f"must be a list of {what}; item {bad} is {_got(v[bad])}"
    return check


_ints = _list_of(_is_int, "integers")
_logprobs = _list_of(lambda x: x is None or _is_num(x), "numbers or nulls")

# --- routed experts (MoE routing replay, docs/guide/moe.md#mixture-of-experts-rollout-and-routing-replay) ---

MAX_ROUTED_EXPERTS = 256  # ids travel as one byte each, as vLLM's own record does


@dataclass(frozen=True)
class RoutedExperts:
    """The experts a source's positions were routed to, per MoE layer: row-major
    [rows, layers, topk] ids, one byte each. Row i is the source's i-th position (a
    turn's: its trajectory position start + i); the rollout records the positions it fed
    through the model, which is every one but a trajectory's last (the last sampled token
    is never fed back, and its output scores nothing)."""

    layers: int
    topk: int
    ids: bytes

    @property
    def rows(self) -> int:
        return len(self.ids) // (self.layers * self.topk)

    def array(self) -> np.ndarray:
        """[rows, layers, topk] uint8, read-only (a view of `ids`)."""
        return np.frombuffer(self.ids, dtype=np.uint8).reshape(-1, self.layers, self.topk)

    def slice(self, a: int, b: int) -> "RoutedExperts":
        """Rows a..b−1 (clipped to the rows held)."""
        row = self.layers * self.topk
        return RoutedExperts(self.layers, self.topk, self.ids[a * row:b * row])

    @classmethod
    def from_array(cls, a) -> "RoutedExperts":
        """From an integer array [rows, layers, topk] of ids in 0..255."""
        a = np.asarray(a)
        if a.ndim != 3 or a.shape[1] < 1 or a.shape[2] < 1:
            raise SourceError(f"routed_experts must be [rows, layers, topk], got shape "
                              f"{list(a.shape)}")
        if a.size and (a.dtype.kind not in "iu" or a.min() < 0
                       or a.max() >= MAX_ROUTED_EXPERTS):
            raise SourceError(f"routed_experts must hold expert ids in 0..255, got "
                              f"{a.dtype} values {a.min()}..{a.max()}")
        return cls(int(a.shape[1]), int(a.shape[2]), a.astype(np.uint8).tobytes())

    @classmethod
    def from_json(cls, v: Any) -> "RoutedExperts":
        """From nested JSON lists [rows][layers][topk] of integers."""
        try:
            a = np.array(v, dtype=object)
        except ValueError:
            a = None
        if a is None or a.ndim != 3 or not all(_is_int(x) for x in a.flat):
            raise SourceError("routed_experts must be nested lists [rows][layers][topk] of "
                              "integers, every row the same shape")
        return cls.from_array(a.astype(np.int64))


def check_routing(name: str, routed: RoutedExperts, rows: int, layers: int, topk: int,
                  experts: int) -> None:
    """A source's routed experts fit the model: its MoE layers and top-k, `rows` rows,
    every id a real expert, no expert twice for one token in one layer."""
    if (routed.layers, routed.topk) != (layers, topk):
        raise SourceError(f"{name}: routed_experts has {routed.layers} layers × top-{routed.topk}"
                          f", the model routes {layers} MoE layers × top-{topk}")
    if len(routed.ids) != rows * layers * topk:
        raise SourceError(f"{name}: routed_experts has {len(routed.ids) / (layers * topk):g} "
                          f"rows, expected {rows} (one per position fed through the model)")
    a = routed.array()
    if a.size and int(a.max()) >= experts:
        raise SourceError(f"{name}: routed expert id {int(a.max())} out of range: the model "
                          f"has {experts} experts")
    if topk > 1 and a.size and bool((np.diff(np.sort(a, axis=-1), axis=-1) == 0).any()):
        raise SourceError(f"{name}: routed_experts names an expert twice for one token in one "
                          f"layer")


def _routed_field(obj: dict, name: str) -> RoutedExperts | None:
    """A record's routed_experts (None when absent); a bad one is named with its record."""
    if "routed_experts" not in obj:
        return None
    try:
        return RoutedExperts.from_json(obj["routed_experts"])
    except SourceError as e:
        raise SourceError(f"{name}: {e}") from None


def _routed(v: Any) -> str | None:
    """JSON field check: the shape and values are RoutedExperts.from_json's."""
    return None if isinstance(v, list) else f"must be nested lists [rows][layers][topk], got {_got(v)}"


# Field → checker, per record kind: (required, optional).
GRPO_FIELDS: tuple[dict[str, Check], dict[str, Check]] = (
    {"traj_id": _id, "group_id": _id, "tokens": _ints, "scored_mask": _ints,
     "reward": _finite, "policy_version": _int},
    {"ready_order": _int, "prompt_len": _int_or_null, "behaviour_logprobs": _logprobs,
     "token_versions": _ints, "routed_experts": _routed, "segment": _int,
     "n_segments": _int, "trajectory_scored": _int_or_null})
OPD_FIELDS: tuple[dict[str, Check], dict[str, Check]] = (
    {"traj_id": _id, "group_id": _id, "tokens": _ints, "scored_mask": _ints,
     "teacher_logprobs": _logprobs, "turn_ends": _ints, "turn_ready_order": _ints,
     "policy_version": _int},
    {"prompt_len": _int_or_null, "behaviour_logprobs": _logprobs, "token_versions": _ints,
     "routed_experts": _routed})


def check_record(obj: Any, fields: tuple[dict[str, Check], dict[str, Check]]) -> str:
    """The record is a JSON object with exactly its kind's fields, each of the right type;
    returns its name for later messages. Misspelt fields get a did-you-mean."""
    if not isinstance(obj, dict):
        raise SourceError(f"a record must be a JSON object, got {_got(obj)}")
    required, optional = fields
    known = {**required, **optional}
    tid = obj.get("traj_id")
    name = f"trajectory {_got(tid)}" if _id(tid) is None else "record"
    problems, unknown = [], []
    for k in obj:
        if k not in known:
            close = difflib.get_close_matches(str(k)[:100], list(known), n=1)
            unknown.append(_short(str(k)) + (f" (did you mean {close[0]!r}?)" if close else ""))
    if unknown:
        problems.append(f"unknown field{'s' if len(unknown) > 1 else ''} " + ", ".join(unknown))
    missing = [k for k in required if k not in obj]
    if missing:
        problems.append(f"missing field{'s' if len(missing) > 1 else ''} "
                        + ", ".join(repr(k) for k in missing))
    if problems:
        raise SourceError(f"{name}: {'; '.join(problems)}")
    for k, check in known.items():
        if k in obj and (why := check(obj[k])) is not None:
            raise SourceError(f"{name}: {k} {why}")
    return name


@dataclass(frozen=True)
class TrajectorySource:
    """One GRPO trajectory — or one segment of it. A trajectory whose history was rewritten
    mid-episode (a chat template that drops earlier turns' reasoning, an agent that compacts
    its context or hands work to a sub-agent) is a list of segments, each a token sequence
    with its own context; each segment travels as a source with the trajectory's id and
    reward, `segment` its index and `n_segments` their count, and every segment's scored
    tokens train with the trajectory's advantage. `trajectory_scored` is the whole
    trajectory's scored-token count (the per-trajectory token norms weight by it before
    every segment has arrived); None: this source's own (one segment)."""

    traj_id: str
    group_id: str
    tokens: tuple[int, ...]
    scored_mask: tuple[int, ...]
    reward: float
    policy_version: int  # the policy that sampled its scored tokens (the oldest, if several)
    ready_order: int = 0
    prompt_len: int | None = None  # the group's shared prompt length, when the rollout knows it
    # Off-policy data (docs/design/async.md). The rollout's sampling log-prob of each token (None
    # where unscored); () when it sent none. The version that sampled each token, where a
    # weight swap happened mid-trajectory (fully_async); (): every token was policy_version's.
    behaviour_logprobs: tuple[float | None, ...] = ()
    token_versions: tuple[int, ...] = ()
    # MoE: the experts the rollout routed each position to (None: not sent), rows for
    # positions 0..n_tokens − 2 (docs/guide/moe.md#mixture-of-experts-rollout-and-routing-replay)
    routed_experts: RoutedExperts | None = None
    segment: int = 0
    n_segments: int = 1
    trajectory_scored: int | None = None

    @property
    def n_scored(self) -> int:
        return sum(self.scored_mask)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def scored_in_trajectory(self) -> int:
        """L_i: the scored tokens of its whole trajectory, every segment."""
        return self.n_scored if self.trajectory_scored is None else self.trajectory_scored

    @property
    def key(self) -> str:
        """Its unit key: the trajectory id, or "id/s" for segment s of several."""
        return self.traj_id if self.n_segments == 1 else f"{self.traj_id}/{self.segment}"

    @property
    def context(self) -> str:
        """What its positions belong to (routing replay, shared-prompt owners): the
        trajectory, or this segment of it (segments have contexts of their own)."""
        return self.key

    @property
    def index(self) -> int:  # its place among its trajectory's release units
        return self.segment

    chained = False  # its segments are independent sequences: none waits for another

    def to_json(self) -> dict:
        """Its GRPO JSON Lines record (what `from_json` reads: a replay file's line)."""
        obj = dict(traj_id=self.traj_id, group_id=self.group_id, tokens=list(self.tokens),
                   scored_mask=list(self.scored_mask), reward=float(self.reward),
                   policy_version=self.policy_version, ready_order=self.ready_order,
                   prompt_len=self.prompt_len)
        if self.behaviour_logprobs:
            obj["behaviour_logprobs"] = list(self.behaviour_logprobs)
        if self.token_versions:
            obj["token_versions"] = list(self.token_versions)
        if self.routed_experts is not None:
            obj["routed_experts"] = self.routed_experts.array().tolist()
        if self.n_segments != 1:
            obj.update(segment=self.segment, n_segments=self.n_segments,
                       trajectory_scored=self.trajectory_scored)
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "TrajectorySource":
        """One GRPO JSON Lines record; a wrong key set or field type is a SourceError.
        Values (vocabulary, mask, prompt_len range) are validate_source's."""
        name = check_record(obj, GRPO_FIELDS)
        return cls(
            traj_id=str(obj["traj_id"]),
            group_id=str(obj["group_id"]),
            tokens=tuple(obj["tokens"]),
            scored_mask=tuple(obj["scored_mask"]),
            reward=obj["reward"],
            policy_version=obj["policy_version"],
            ready_order=obj.get("ready_order", 0),
            prompt_len=obj.get("prompt_len"),
            behaviour_logprobs=tuple(obj.get("behaviour_logprobs", ())),
            token_versions=tuple(obj.get("token_versions", ())),
            routed_experts=_routed_field(obj, name),
            segment=obj.get("segment", 0),
            n_segments=obj.get("n_segments", 1),
            trajectory_scored=obj.get("trajectory_scored"),
        )


def check_version(name: str, version: int, current: int, max_lag: int = 0) -> None:
    """A source trains only in an update of the policy that sampled it (max_lag 0: the
    synchronous schedules), or of one at most `max_lag` updates later (the asynchronous
    baselines); never on a future policy."""
    if max_lag == 0 and version != current:
        raise SourceError(f"{name}: policy version {version} is not the current version "
                          f"{current}; stale or future sources are never trained on")
    if not current - max_lag <= version <= current:
        raise SourceError(f"{name}: policy version {version} is {current - version} updates "
                          f"behind the current version {current}; this schedule trains on "
                          f"versions {max(0, current - max_lag)}..{current} only")


def check_off_policy(name: str, src, start: int = 0) -> None:
    """behaviour_logprobs and token_versions: absent, or one per token, finite log-probs
    at every scored token, versions within [policy_version, ...] (the oldest is the
    source's own)."""
    n, mask = len(src.tokens), src.scored_mask
    lps, vs = src.behaviour_logprobs, src.token_versions
    if lps:
        if len(lps) != n:
            raise SourceError(f"{name}: behaviour_logprobs has {len(lps)} entries for {n} tokens")
        for i, (m, lp) in enumerate(zip(mask, lps)):
            if m and (lp is None or isinstance(lp, bool) or not isinstance(lp, (int, float))
                      or not math.isfinite(lp) or not TEACHER_LOGPROB_FLOOR <= lp <= 0):
                raise SourceError(f"{name}: behaviour log-prob {lp!r} at token {start + i} is "
                                  f"not a log-probability in [{TEACHER_LOGPROB_FLOOR:g}, 0]")
    if vs:
        if len(vs) != n:
            raise SourceError(f"{name}: token_versions has {len(vs)} entries for {n} tokens")
        bad = [v for v in vs if isinstance(v, bool) or not isinstance(v, int)]
        if bad:
            raise SourceError(f"{name}: token_versions must hold integers, got {bad[0]!r}")
        scored = [v for m, v in zip(mask, vs) if m]
        if scored and min(scored) != src.policy_version:
            raise SourceError(f"{name}: policy_version {src.policy_version} is not the oldest "
                              f"version of its scored tokens ({min(scored)})")


def _check_ids_and_mask(name: str, tokens, mask, vocab_size: int) -> None:
    bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool)
           or t < 0 or t >= vocab_size]
    if bad:
        raise SourceError(f"{name}: token ids {bad[:5]} out of vocabulary [0, {vocab_size})")
    if any(m not in (0, 1) for m in mask):
        raise SourceError(f"{name}: scored_mask must hold only 0/1")


def _check_prompt_len(name: str, prompt_len, mask) -> None:
    if prompt_len is None:
        return
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) \
            or not 0 <= prompt_len < len(mask) or any(mask[:prompt_len]):
        raise SourceError(f"{name}: prompt_len {prompt_len!r} must be an integer in [0, "
                          f"{len(mask)}) covering only unscored tokens")


def validate_source(src: TrajectorySource, vocab_size: int, max_tokens: int | None = None) -> None:
    """Shape/content checks that need no batch context."""
    name = f"trajectory {src.traj_id!r} (group {src.group_id!r})"
    if len(src.tokens) == 0:
        raise SourceError(f"{name}: empty token list")
    check_length(name, len(src.tokens), max_tokens)  # before any per-token work
    if len(src.tokens) != len(src.scored_mask):
        raise SourceError(
            f"{name}: scored_mask has {len(src.scored_mask)} entries but tokens has "
            f"{len(src.tokens)}; they must be the same length")
    _check_ids_and_mask(name, src.tokens, src.scored_mask, vocab_size)
    if src.scored_mask[0]:
        # The first token has no context, so its log-prob is undefined.
        raise SourceError(f"{name}: the first token cannot be scored (no context)")
    _check_prompt_len(name, src.prompt_len, src.scored_mask)
    check_reward(name, src.reward)
    if not isinstance(src.policy_version, int) or isinstance(src.policy_version, bool):
        raise SourceError(f"{name}: policy_version must be an integer")
    check_segment(name, src)
    check_off_policy(name, src)


def check_segment(name: str, src: TrajectorySource) -> None:
    """segment / n_segments / trajectory_scored: integers, 0 ≤ segment < n_segments ≤
    MAX_SEGMENTS, and the trajectory's scored count at least this segment's."""
    n, s, total = src.n_segments, src.segment, src.trajectory_scored
    if not _is_int(n) or not 1 <= n <= MAX_SEGMENTS:
        raise SourceError(f"{name}: n_segments must be an integer in [1, {MAX_SEGMENTS}], "
                          f"got {n!r}")
    if not _is_int(s) or not 0 <= s < n:
        raise SourceError(f"{name}: segment must be an integer in [0, {n}), got {s!r}")
    if total is not None and (not _is_int(total) or total < src.n_scored):
        raise SourceError(f"{name}: trajectory_scored {total!r} must be an integer ≥ this "
                          f"segment's {src.n_scored} scored tokens")
    if n > 1 and total is None:
        raise SourceError(f"{name}: segment {s} of {n} without trajectory_scored (the "
                          f"trajectory's scored tokens over all its segments)")


@dataclass
class BatchPlan:
    """The registered groups of one update: group id → trajectory ids, in order, and (OPD)
    each trajectory's turn count. Registered order is also sync's serving order."""

    groups: dict[str, list[str]] = field(default_factory=dict)
    n_turns: dict[str, int] = field(default_factory=dict)  # trajectory → turns (turn sources)

    def add_group(self, group_id: str, traj_ids: list[str]) -> None:
        if group_id in self.groups:
            raise SourceError(f"group {group_id!r} registered twice")
        if len(set(traj_ids)) != len(traj_ids) or not traj_ids:
            raise SourceError(f"group {group_id!r}: trajectory ids must be unique and non-empty")
        self.groups[group_id] = list(traj_ids)

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    @classmethod
    def from_sources(cls, sources: list) -> "BatchPlan":
        """Groups in first-seen order; turn sources also give their trajectory's turn count."""
        plan = cls()
        members: dict[str, list[str]] = {}
        for s in sources:
            ts = members.setdefault(s.group_id, [])
            if s.traj_id not in ts:
                ts.append(s.traj_id)
            if hasattr(s, "n_turns"):
                plan.n_turns[s.traj_id] = s.n_turns
        for gid, tids in members.items():
            plan.add_group(gid, tids)
        return plan


def assign_groups(plan: BatchPlan, group_tokens: dict[str, int], n_ranks: int) -> dict[str, int]:
    """Deterministic token-balanced assignment of groups to data-parallel ranks.

    Longest-processing-time greedy: largest groups first onto the least-loaded rank;
    ties broken by group id and rank index, so every rank computes the same answer.
    """
    load = [0] * n_ranks
    count = [0] * n_ranks  # breaks ties (and balances when token counts are not known yet)
    owner: dict[str, int] = {}
    for gid in sorted(plan.groups, key=lambda g: (-group_tokens.get(g, 0), g)):
        r = min(range(n_ranks), key=lambda i: (load[i], count[i], i))
        owner[gid] = r
        load[r] += group_tokens.get(gid, 0)
        count[r] += 1
    return owner


@dataclass(frozen=True)
class TurnSource:
    """One agentic turn of an OPD trajectory: tokens [start, end) with teacher scores.

    Ready when the frozen teacher has scored the turn's action tokens in their realized
    context. `teacher_logprobs[i]` belongs to token start+i (None where unscored).
    """

    traj_id: str
    group_id: str
    turn: int  # index within the trajectory
    n_turns: int
    start: int
    tokens: tuple[int, ...]  # this turn's span
    scored_mask: tuple[int, ...]
    teacher_logprobs: tuple[float | None, ...]
    policy_version: int
    ready_order: int = 0
    prompt_len: int | None = None  # shared prompt length of the group (turn 0 starts with it)
    behaviour_logprobs: tuple[float | None, ...] = ()  # as TrajectorySource's, for this span
    token_versions: tuple[int, ...] = ()
    # MoE: the rollout's experts for positions start.. of this span (its last turn: all but
    # the trajectory's last position); None: not sent
    routed_experts: RoutedExperts | None = None

    @property
    def routed_rows(self) -> int:
        """Rows its routed_experts must have: one per position fed through the model."""
        return len(self.tokens) - (1 if self.turn == self.n_turns - 1 else 0)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def n_scored(self) -> int:
        return sum(self.scored_mask)

    @property
    def key(self) -> str:
        return f"{self.traj_id}#{self.turn}"

    @property
    def index(self) -> int:  # its place among its trajectory's release units
        return self.turn

    @property
    def context(self) -> str:  # a turn continues its trajectory's context
        return self.traj_id

    chained = True  # a turn runs against its trajectory's previous turns: served in order


def opd_turns_from_json(obj: dict) -> list[TurnSource]:
    """Split one OPD JSON Lines record into its turn sources, validating key set, field
    types and alignment."""
    name = check_record(obj, OPD_FIELDS)
    toks, mask, teacher = obj["tokens"], obj["scored_mask"], obj["teacher_logprobs"]
    ends, order = obj["turn_ends"], obj["turn_ready_order"]
    if not (len(toks) == len(mask) == len(teacher)):
        raise SourceError(f"{name}: tokens ({len(toks)}), scored_mask ({len(mask)}) and "
                          f"teacher_logprobs ({len(teacher)}) must be the same length")
    if not ends or any(b <= a for a, b in zip([0] + ends, ends)) or ends[-1] != len(toks):
        raise SourceError(f"{name}: turn_ends {ends} must increase strictly and end at "
                          f"len(tokens) = {len(toks)}")
    if len(order) != len(ends):
        raise SourceError(f"{name}: turn_ready_order has {len(order)} entries for {len(ends)} turns")
    lps, vs = obj.get("behaviour_logprobs", []), obj.get("token_versions", [])
    routed = _routed_field(obj, name)
    if routed is not None and routed.rows != len(toks) - 1:
        raise SourceError(f"{name}: routed_experts has {routed.rows} rows, expected "
                          f"{len(toks) - 1} (every position but the last)")
    for what, xs in (("behaviour_logprobs", lps), ("token_versions", vs)):
        if xs and len(xs) != len(toks):
            raise SourceError(f"{name}: {what} has {len(xs)} entries for {len(toks)} tokens")
    turns, start = [], 0
    for j, end in enumerate(ends):
        turns.append(TurnSource(
            traj_id=str(obj["traj_id"]), group_id=str(obj["group_id"]), turn=j,
            n_turns=len(ends), start=start, tokens=tuple(toks[start:end]),
            scored_mask=tuple(mask[start:end]), teacher_logprobs=tuple(teacher[start:end]),
            policy_version=obj["policy_version"], ready_order=order[j],
            prompt_len=obj.get("prompt_len"),
            behaviour_logprobs=tuple(lps[start:end]), token_versions=tuple(vs[start:end]),
            routed_experts=routed.slice(start, end) if routed is not None else None))
        start = end
    return turns


def validate_turn(src: TurnSource, vocab_size: int, max_tokens: int | None = None) -> None:
    name = f"turn {src.turn} of trajectory {src.traj_id!r}"
    if not src.tokens:
        raise SourceError(f"{name}: empty span")
    if isinstance(src.start, bool) or not isinstance(src.start, int) or src.start < 0:
        raise SourceError(f"{name}: start must be an integer ≥ 0, got {src.start!r}")
    check_length(name, src.end, max_tokens)  # the turn's end: its context is attended too
    if not (len(src.tokens) == len(src.scored_mask) == len(src.teacher_logprobs)):
        raise SourceError(f"{name}: tokens, scored_mask and teacher_logprobs differ in length "
                          f"({len(src.tokens)}, {len(src.scored_mask)}, "
                          f"{len(src.teacher_logprobs)})")
    _check_ids_and_mask(name, src.tokens, src.scored_mask, vocab_size)
    if src.scored_mask[0] and src.start == 0:
        # A later turn may start with a scored token (the learner scores it from the
        # previous turn's last position); the trajectory's first token has no context.
        raise SourceError(f"{name}: the first token of a trajectory cannot be scored (no context)")
    if src.turn == 0:
        _check_prompt_len(name, src.prompt_len, src.scored_mask)
    for i, (m, lp) in enumerate(zip(src.scored_mask, src.teacher_logprobs)):
        if not m:
            continue
        if lp is None:
            raise SourceError(f"{name}: teacher log-prob missing for scored token {src.start + i}")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) \
                or not TEACHER_LOGPROB_FLOOR <= lp <= 0:
            raise SourceError(f"{name}: teacher log-prob {lp!r} at token {src.start + i} is not "
                              f"a log-probability in [{TEACHER_LOGPROB_FLOOR:g}, 0] (a masked "
                              f"logit gives −inf/−3.4e38: the teacher cannot have sampled it)")
    if not isinstance(src.policy_version, int) or isinstance(src.policy_version, bool):
        raise SourceError(f"{name}: policy_version must be an integer")
    check_off_policy(name, src, src.start)
