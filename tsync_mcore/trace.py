"""The learner's trace: typed, versioned records, one JSON object per line.

Three record kinds, written by the learner per rank and update, read back by the FLOP
ledger, the predictor, the report and the benchmarks through the same types:

    SourceRecord    one source (a GRPO trajectory, an OPD turn): when it was ready, when it
                    was served (start/end/cpu; None if it was not served on this rank), how
                    it folded, and the span that ran (span_tokens after context tokens of
                    K/V; logits: whether the LM head and the scored-token loss ran)
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

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable, Literal, Union

SCHEMA_VERSION = 1


class TraceError(ValueError):
    """A trace line is malformed or of another schema version; the message names it."""


@dataclass
class SourceRecord:
    update: int  # the policy version this update trains from (θ_k)
    rank: int
    source: Literal["trajectory", "turn"]
    traj_id: str
    group_id: str
    turn: int | None  # OPD: index of the turn in its trajectory; None for trajectories
    policy_version: int  # the version that sampled the source (== update when on-policy)
    scored_tokens: int
    ready: float
    start: float | None = None
    end: float | None = None
    cpu: float | None = None  # this thread's CPU seconds over [start, end]
    fold: Literal["direct", "pair"] | None = None  # pair: into the group's G1'/G2
    closes_group: bool = False
    open_groups: int = 0  # groups holding open state on this rank when it was served
    span_tokens: int = 0  # tokens forwarded (and backpropagated) by its service
    context: int = 0  # K/V positions it attended to before its span
    logits: bool = False  # the LM head and the scored-token loss ran
    kind: Literal["source"] = "source"

    @property
    def served(self) -> bool:
        return self.start is not None and self.end is not None


@dataclass
class DeferredRecord:
    update: int
    rank: int
    work: Literal["replay", "prefix"]
    group_id: str
    traj_id: str | None  # replay: the trajectory whose context is replayed
    ready: float
    start: float
    end: float
    cpu: float
    # (tokens, context) of every span pushed back through; prefix: [(prompt tokens, 0)]
    spans: list[tuple[int, int]] = field(default_factory=list)
    replay_mode: Literal["recompute", "retain"] | None = None  # how replay got each span's K/V
    kind: Literal["deferred"] = "deferred"

    @property
    def served(self) -> bool:
        return True


@dataclass
class UpdateRecord:
    update: int
    rank: int
    objective: str
    schedule: str
    n_groups: int  # groups that trained (over all ranks)
    n_sources: int  # sources served on this rank
    scored_tokens: int  # scored tokens that trained (over all ranks): N_k
    dropped_groups: dict[str, str] = field(default_factory=dict)  # group → why (all ranks)
    rejected_sources: dict[str, str] = field(default_factory=dict)  # source → why (this rank)
    open_bound: str = ""  # the admission bound that applied: "k_open=4", "4 MiB", ...
    accum_peak_bytes: int = 0  # batch accumulator + G1'/G2 pairs held at once
    accum_bound_bytes: int = 0  # 4·(2k+1)·P
    open_peak_bytes: int = 0  # bytes held by open groups at once (pairs, K/V, prompts)
    kv_peak_bytes: int = 0  # context K/V leaves + adjoints and shared prompts at once
    grad_norm: float = 0.0
    ok: bool = True
    kind: Literal["update"] = "update"

    @property
    def served(self) -> bool:
        return False


Record = Union[SourceRecord, DeferredRecord, UpdateRecord]
_KINDS: dict[str, type] = {"source": SourceRecord, "deferred": DeferredRecord,
                           "update": UpdateRecord}


def to_json(rec: Record) -> str:
    return json.dumps({"schema": SCHEMA_VERSION, **asdict(rec)})


def parse(obj, where: str = "trace") -> Record:
    """One record from its JSON object; TraceError names what is wrong and where."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    if obj.get("schema") != SCHEMA_VERSION:
        raise TraceError(f"{where}: trace schema {obj.get('schema')!r}, this reader speaks "
                         f"{SCHEMA_VERSION}")
    cls = _KINDS.get(obj.get("kind"))
    if cls is None:
        raise TraceError(f"{where}: unknown record kind {obj.get('kind')!r}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(obj) - names - {"schema"})
    if unknown:
        raise TraceError(f"{where}: {obj['kind']} record has unknown fields {unknown}")
    try:
        rec = cls(**{k: v for k, v in obj.items() if k != "schema"})
    except TypeError as e:  # a required field is missing
        raise TraceError(f"{where}: {obj['kind']} record: {e}") from None
    if isinstance(rec, DeferredRecord):
        rec.spans = [tuple(s) for s in rec.spans]
    return rec


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


def write(path: str, records: Iterable[Record], mode: str = "a") -> None:
    with open(path, mode) as f:
        for rec in records:
            f.write(to_json(rec) + "\n")


def sources(records: Iterable[Record]) -> list[SourceRecord]:
    return [r for r in records if isinstance(r, SourceRecord)]


def work(records: Iterable[Record]) -> list[SourceRecord | DeferredRecord]:
    """Records of learner work that ran (served sources and deferred work)."""
    return [r for r in records if r.served]
