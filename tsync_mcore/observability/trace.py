"""The learner's trace: typed, versioned records, one JSON object per line.

Three record kinds, written by the learner per rank and update, read back by the FLOP
ledger, the predictor, the report and the benchmarks through the same types:

    SourceRecord    one source (a GRPO trajectory, an OPD turn): when it was ready, when it
                    was served (start/end/cpu; None if it was not served on this rank), how
                    it folded, and the span that ran (span_tokens after context tokens of
                    K/V; logits: whether the LM head and the scored-token loss ran; pass_id: the
                    packed pass it shared with other sources)
    DeferredRecord  work that runs after the sources it belongs to: an OPD trajectory's
                    context replay ("replay": the spans pushed back through, recomputed or
                    retained) or a shared prompt's backward ("prefix")
    UpdateRecord    what the update did on this rank: counts, dropped groups, memory bounds
                    and peaks, the step's outcome

Every line carries `schema` (SCHEMA_VERSION) and `kind`; `parse` rejects anything else with
a one-line error naming the line. Times are seconds since the update's start (the arrival
of its registration), on this rank's clock.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import re
import types
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Iterable, Literal, Union, get_args, get_origin, get_type_hints

SCHEMA_VERSION = 4  # 2: UpdateRecord.head_peak_bytes, SourceRecord.fused_head and pass_id;
#                     3: UpdateRecord.accum_params; 4: UpdateRecord.dummy_passes


def tokens_digest(tokens, scored_mask) -> str:
    """sha256 of a source's token ids and scored mask (SourceRecord.tokens_sha256)."""
    import hashlib

    body = json.dumps([[int(t) for t in tokens], [int(m) for m in scored_mask]],
                      separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


class TraceError(ValueError):
    """A trace line is malformed or of another schema version; the message names it."""


@dataclass
class SourceRecord:
    update: int  # the policy version this update trains from (θ_k)
    rank: int  # the learner rank that wrote it (global rank)
    source: Literal["trajectory", "turn"]  # a GRPO trajectory or an OPD turn
    traj_id: str  # the trajectory (an OPD turn's: the one it belongs to)
    group_id: str  # its group, registered with the batch
    turn: int | None  # OPD: index of the turn in its trajectory; None for trajectories
    policy_version: int  # the version that sampled the source (== update when on-policy)
    scored_tokens: int  # tokens the loss scores
    ready: float  # when it reached this rank
    policy_lag: int = 0  # update − policy_version: how many updates behind θ_k it was sampled
    lagged_tokens: int = 0  # its scored tokens sampled by a version older than θ_k
    start: float | None = None  # service start; None: not served on this rank
    end: float | None = None  # service end (its tensors freed)
    cpu: float | None = None  # this thread's CPU seconds over [start, end]
    fold: Literal["direct", "pair"] | None = None  # pair: into the group's G1'/G2
    closes_group: bool = False  # its service completed its group's G1'/G2 pair
    open_groups: int = 0  # groups holding open state on this rank when it was served
    span_tokens: int = 0  # tokens forwarded (and backpropagated) by its service
    context: int = 0  # K/V positions it attended to before its span
    logits: bool = False  # the LM head and the scored-token loss ran
    # the fused LM head ran (learner.fused_lm_head): only the scored positions were projected
    # to the vocabulary, and their logits recomputed in backward
    fused_head: bool = False
    # packed serving: the pass (numbered per update and rank) it ran in with other sources;
    # start/end/cpu are then its share of the pass, split by span tokens; None: alone
    pass_id: int | None = None
    # sha256 of the source's tokens and scored mask as this rank received them
    # (tokens_digest): compared with the rollout's records (RUN/agent/records.jsonl)
    tokens_sha256: str | None = None
    # tokens the KL term's reference model forwarded for it (no backward; learner.kl_coef)
    reference_tokens: int = 0
    # learner.minibatches > 1: its PPO mini-batch (1: streamed; 2..m: served at close after
    # the previous mini-batch's step) and the tokens forwarded at arrival, without a
    # backward, for its old log-probs (mini-batches 2..m)
    minibatch: int = 1
    old_logprob_tokens: int = 0
    # a trajectory cut into several segments (history rewrites): this source's segment
    # index; None: the trajectory is one sequence
    segment: int | None = None
    # a GRPO trajectory's reward as this rank received it (compared with the rollout's
    # records, e.g. RUN/judge/records.jsonl); None for OPD turns
    reward: float | None = None
    kind: Literal["source"] = "source"  # fixed per class

    @property
    def served(self) -> bool:
        return self.start is not None and self.end is not None


@dataclass
class DeferredRecord:
    update: int
    rank: int
    # an OPD context replay, a shared prompt's backward, or a later PPO mini-batch source's
    # forward at arrival for its old log-probs (its FLOPs are on its SourceRecord)
    work: Literal["replay", "prefix", "old_logprob"]
    group_id: str
    traj_id: str | None  # replay: the trajectory whose context is replayed
    ready: float  # when it could run: when the sources it belongs to were served
    start: float  # when it ran
    end: float
    cpu: float  # this thread's CPU seconds over [start, end]
    # (tokens, context) of every span pushed back through; prefix: [(prompt tokens, 0)]
    spans: list[tuple[int, int]] = field(default_factory=list)
    replay_mode: Literal["recompute", "retain"] | None = None  # how replay got each span's K/V
    kind: Literal["deferred"] = "deferred"  # fixed per class

    @property
    def served(self) -> bool:
        return True


@dataclass
class UpdateRecord:
    update: int
    rank: int
    objective: str  # grpo, dr_grpo, rloo, opd
    schedule: str  # the release schedule of this batch
    n_groups: int  # groups that trained (over all ranks)
    n_sources: int  # sources served on this rank
    scored_tokens: int  # scored tokens that trained (over all ranks): N_k
    dropped_groups: dict[str, str] = field(default_factory=dict)  # group → why (all ranks)
    # [source, why] of every source refused on this rank (a source may be refused twice)
    rejected_sources: list[tuple[str, str]] = field(default_factory=list)
    open_bound: str = ""  # the admission bound that applied: "k_open=4", "4 MiB", ...
    accum_peak_bytes: int = 0  # batch accumulator + G1'/G2 pairs held at once
    accum_bound_bytes: int = 0  # 4·(2k+1)·P
    # P: gradient elements per accumulator vector on this rank (its DDP grad buffers: the
    # adapters' P_A under LoRA)
    accum_params: int = 0
    open_peak_bytes: int = 0  # bytes held by open groups at once (pairs, K/V, prompts)
    kv_peak_bytes: int = 0  # context K/V leaves + adjoints and shared prompts at once
    # LM head's estimated peak of one source or span (kernels/lm_head.py peak_bytes): fused,
    # a chunk's logits + gradient, grad_h and the weight-gradient accumulator; unfused, the
    # [S, V/TP] logits, the scored rows' copy and both gradients
    head_peak_bytes: int = 0
    grad_norm: float = 0.0  # before clipping
    lr: float = 0.0  # the learning rate of this update's step (optim.lr_schedule)
    ok: bool = True  # the step was applied (False: the reduced gradient was not finite)
    # learner.check_finite=source: the unit after whose service this rank's sums were first
    # non-finite (empty: finite here, or not checked per source)
    nonfinite_sources: list[str] = field(default_factory=list)
    # model.ep > 1: forward/backward passes this rank ran with nothing to serve, so that its
    # expert-parallel peers' passes could complete (its own gradient dropped, its experts'
    # share of the peers' kept; no source record, so no FLOPs counted)
    dummy_passes: int = 0
    # Policy lag of the scored tokens that trained (over all ranks; docs/design/async.md#off-policy-correction-and-the-lag-and-mismatch-figures):
    # mean of update − (the version that sampled the token), its max, share with lag > 0
    policy_lag_mean: float = 0.0
    policy_lag_max: int = 0
    lagged_token_share: float = 0.0
    # Rollout/learner mismatch over the scored tokens served with a behaviour log-prob (over
    # all ranks; null when none had one), whether the correction is on or off
    mismatch_tokens: int = 0  # scored tokens with a behaviour log-prob
    logprob_diff_mean: float | None = None  # mean |log π_θ − log π_behaviour|
    is_weight_mean: float | None = None  # mean of π_θ/π_behaviour (before truncation)
    is_weight_max: float | None = None
    is_weight_min: float | None = None
    is_truncated_share: float | None = None  # share whose weight the cap truncated
    is_dropped_share: float | None = None  # share the guard gave weight 0 (mis, seq_*)
    # learner.kl_coef > 0: the KL estimator's mean over the scored tokens served (actor/kl)
    kl_mean: float | None = None
    reference_bytes: int = 0  # the KL term's reference model weights on this rank (0: none or the LoRA base)
    minibatch_steps: int = 1  # optimizer steps applied (learner.minibatches)
    # PPO mini-batches 2..m: share of scored tokens whose ratio clip (dual clip) was binding,
    # mean log π_θk − log π_θ (verl actor/pg_clipfrac, pg_clipfrac_lower, ppo_kl)
    pg_clipfrac: float | None = None
    pg_clipfrac_lower: float | None = None
    ppo_kl: float | None = None
    kind: Literal["update"] = "update"  # fixed per class

    @property
    def served(self) -> bool:
        return False


Record = Union[SourceRecord, DeferredRecord, UpdateRecord]
_KINDS: dict[str, type] = {"source": SourceRecord, "deferred": DeferredRecord,
                           "update": UpdateRecord}
_HINTS = {cls: get_type_hints(cls) for cls in _KINDS.values()}  # annotations, resolved


def to_json(rec: Record) -> str:
    return json.dumps({"schema": SCHEMA_VERSION, **asdict(rec)})


def parse(obj, where: str = "trace") -> Record:
    """One record from its JSON object; TraceError names what is wrong and where."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    if obj.get("schema") != SCHEMA_VERSION:
        raise TraceError(f"{where}: trace schema {obj.get('schema')!r}, this reader speaks "
                         f"{SCHEMA_VERSION}")
    kind = obj.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise TraceError(f"{where}: unknown record kind {kind!r}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(obj) - names - {"schema"})
    if unknown:
        raise TraceError(f"{where}: {kind} record has unknown fields {unknown}")
    try:
        rec = cls(**{k: v for k, v in obj.items() if k != "schema"})
    except TypeError as e:  # a required field is missing
        raise TraceError(f"{where}: {kind} record: {e}") from None
    for f in fields(cls):  # readers use what parse gives without checking it again
        value = getattr(rec, f.name)
        if not _fits(value, _HINTS[cls][f.name]):
            raise TraceError(f"{where}: {kind} record: {f.name} must be {f.type}, "
                             f"got {value!r:.60}")
    if isinstance(rec, DeferredRecord):
        rec.spans = [tuple(s) for s in rec.spans]
    if isinstance(rec, UpdateRecord):
        rec.rejected_sources = [tuple(s) for s in rec.rejected_sources]
    return rec


def _fits(value, hint) -> bool:
    """Whether a JSON value is of a field's annotated type."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is float:  # a writer may write 0 for 0.0
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool, type(None)):
        return isinstance(value, hint)
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is tuple:  # a JSON array of the tuple's length
        return isinstance(value, (list, tuple)) and len(value) == len(args) \
            and all(_fits(v, a) for v, a in zip(value, args))
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1])
                                               for k, v in value.items())
    raise TypeError(f"trace field type {hint!r} has no JSON check")


def read(path: str) -> list[Record]:
    """Every record of one JSONL file (a line still being written is skipped)."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith("\n") or not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not JSON ({e})") from None
            out.append(parse(obj, f"{path}:{lineno}"))
    return out


def read_run(run_dir: str) -> list[Record]:
    """Every record of a run directory's traces/rank{R}.jsonl, in rank order."""
    paths = glob.glob(os.path.join(run_dir, "traces", "rank*.jsonl"))
    rank = lambda p: int(re.search(r"rank(\d+)\.jsonl$", p).group(1))  # noqa: E731
    return [rec for p in sorted(paths, key=rank) for rec in read(p)]


def write(path: str, records: Iterable[Record], mode: str = "a") -> None:
    with open(path, mode) as f:
        for rec in records:
            f.write(to_json(rec) + "\n")


def sources(records: Iterable[Record]) -> list[SourceRecord]:
    return [r for r in records if isinstance(r, SourceRecord)]


def work(records: Iterable[Record]) -> list[SourceRecord | DeferredRecord]:
    """Records of learner work that ran (served sources and deferred work)."""
    return [r for r in records if r.served]


# --- the field table of docs/design/trace.md, generated so that it cannot go stale ---------------


def field_table() -> str:
    """A Markdown table of every record kind's fields, their types, defaults and comments."""
    out, seen = [], {}
    for kind, cls in _KINDS.items():
        notes = seen | _field_notes(cls)  # a field named as in an earlier kind means the same
        seen = notes
        out += [f"#### {cls.__name__} (`kind: \"{kind}\"`)", "",
                "| field | type | default | meaning |", "|---|---|---|---|"]
        for f in fields(cls):
            if f.default is not MISSING:
                default = f"`{json.dumps(f.default)}`"
            elif f.default_factory is not MISSING:
                default = f"`{json.dumps(f.default_factory())}`"
            else:
                default = "required"
            typ = str(f.type).replace("|", "\\|")
            out.append(f"| `{f.name}` | `{typ}` | {default} | {notes.get(f.name, '')} |")
        out.append("")
    return "\n".join(out)


def _field_notes(cls) -> dict[str, str]:
    """Each field's comment in the class source: on its line, or on the lines just above."""
    notes, above = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        s = line.strip()
        if s.startswith("#"):
            above.append(s[1:].strip())
            continue
        m = re.match(r"(\w+):[^#]*(?:#\s*(.*))?$", s)
        if m:
            notes[m.group(1)] = " ".join(above + ([m.group(2)] if m.group(2) else []))
        above = []
    return notes


if __name__ == "__main__":  # the table docs/design/trace.md carries
    print(field_table())
