"""A cell's figures from the learners' traces and metrics rows: the busiest lane (L), dispatch
cost, packing share, serving wall/CPU, service paired with sync's, the predicted step of
group_ready and the asynchronous schedules, policy lag, and the busy-host flag."""

from __future__ import annotations

from bisect import bisect_left
from statistics import mean, median

from tsync_mcore.observability import predict, trace
from tsync_mcore.observability.trace import Record, SourceRecord


def busiest_lane(records: list[Record], update: int) -> float:
    """L of one update: the busiest rank's total service time."""
    busy = {0: 0.0, 1: 0.0}
    for r in trace.work(records):
        if r.update == update:
            busy[r.rank] += r.end - r.start
    return max(busy.values())


def dispatch_overhead(records: list[Record], updates: set[int]) -> dict:
    """Per-source scheduling + bookkeeping cost as a fraction of learner service (median
    gap ÷ median service). The gap of a source is the time from when its lane could take
    it (its arrival, or the end of the lane's previous entry if that is later) to its
    service start: on an idle lane the wake-up and hand-off from the channel, on a busy
    one the bookkeeping between two services. `all`: every source; `idle`: sources that
    found their lane idle (few at r < 1, where the learner is behind), each counted until
    the lane's next service starts, whichever source that serves (several arriving
    together: the OPD learner may serve another one first). Ready times below 0 (traces
    whose clock started when the learner opened the batch rather than at the
    registration's arrival: a source could come before the learner was ready) do not count
    as an idle lane."""
    gaps, idle, service = [], [], []
    work = trace.work(records)
    for u in updates:
        for r in (0, 1):
            es = sorted((e for e in work if e.update == u and e.rank == r),
                        key=lambda e: e.start)
            prev_end = -1.0
            for e in es:
                if isinstance(e, SourceRecord):
                    gaps.append(e.start - max(e.ready, prev_end))
                    service.append(e.end - e.start)
                prev_end = e.end
            starts = [x.start for x in es]
            for e in es:
                if not isinstance(e, SourceRecord) or e.ready < 0:
                    continue
                i = bisect_left(starts, e.ready)  # es[i]: the lane's next start after it
                if i == 0 or es[i - 1].end <= e.ready:  # lane idle on arrival
                    idle.append(starts[i] - e.ready)
    if not service:
        return dict(all=float("nan"), idle=float("nan"), n_idle=0)
    m = median(service)
    return dict(all=median(gaps) / m, idle=median(idle) / m if idle else float("nan"),
                n_idle=len(idle))


def dispatch_fields(records: list[Record], updates: set[int], streaming: bool) -> dict:
    if not streaming:
        return dict(dispatch_overhead=None, dispatch_idle=None, dispatch_idle_n=None)
    d = dispatch_overhead(records, updates)
    return dict(dispatch_overhead=d["all"], dispatch_idle=d["idle"], dispatch_idle_n=d["n_idle"])


def packed_share(records: list[Record], updates: set[int]) -> float:
    """Share of the served sources that ran in a packed pass with others."""
    srcs = [r for r in trace.sources(records) if r.served and r.update in updates]
    return sum(r.pass_id is not None for r in srcs) / len(srcs) if srcs else 0.0


def serve_cpu(records: list[Record], updates: set[int]) -> float:
    """Serving-thread CPU seconds per update, summed over ranks."""
    return sum(r.cpu for r in trace.work(records) if r.update in updates) / len(updates)


def wall_over_cpu(records: list[Record], updates: set[int],
                  arriving: dict[int, float] | None = None) -> float | None:
    """Serving wall time over serving CPU time. `arriving` (update → R): only services that
    started while sources were still arriving (before R), when the simulator and the
    channel threads share the learners' cores; None where there were none (sync)."""
    es = [e for e in trace.work(records) if e.update in updates
          and (arriving is None or e.start < arriving[e.update])]
    if not es:
        return None
    return sum(e.end - e.start for e in es) / sum(e.cpu for e in es)


def paired_service(by_update: dict[int, list[Record]], mine: list[dict],
                   sync: list[dict]) -> dict:
    """Each source's service (wall, CPU) in this schedule over the same source's in the sync
    update of the same draw (same batch, same tokens): the mean ratio over every source,
    and over those served while sources were still arriving (before R), where the
    simulator and the channel share the learners' cores. Sources are matched by their ids
    without the policy version (and turn)."""
    def key(e: SourceRecord) -> tuple[str, int]:
        return e.traj_id.split("-", 1)[1], e.turn or 0

    sync_of = {r["draw"]: {key(e): e for e in trace.sources(by_update[r["policy_version"]])}
               for r in sync}
    ratios: dict[str, list[tuple[float, float]]] = {"all": [], "arriving": []}
    for r in mine:
        base = sync_of[r["draw"]]
        for e in trace.sources(by_update[r["policy_version"]]):
            b = base.get(key(e))
            if b is None:
                continue
            x = ((e.end - e.start) / (b.end - b.start), e.cpu / b.cpu)
            ratios["all"].append(x)
            if e.start < r["rollout_time_s"]:
                ratios["arriving"].append(x)
    out = {}
    for k, xs in ratios.items():
        sfx = "" if k == "all" else "_arriving"
        out[f"service_vs_sync{sfx}"] = mean(w for w, _ in xs) if xs else None
        out[f"service_cpu_vs_sync{sfx}"] = mean(c for _, c in xs) if xs else None
    out["sources_arriving"] = len(ratios["arriving"]) / max(1, len(ratios["all"]))
    return out


def mark_busy_host(cells: list[dict], margin: float = 0.03) -> list[dict]:
    """Flag (`host_busy`) and return the cells whose serving wall/CPU exceeds the run's
    median for the same schedule by more than `margin`: something else held the learners'
    cores during that cell, and its speedups say more about that than about the code
    (the 21:29 sweep: one cell at 1.105 while every other streaming cell ran at
    1.034–1.059, and its rounds spread ±0.10)."""
    for schedule in {c["schedule"] for c in cells if c.get("wall_over_cpu")}:
        mine = [c for c in cells if c["schedule"] == schedule and c.get("wall_over_cpu")]
        typical = median(c["wall_over_cpu"] for c in mine)
        for c in mine:
            c["host_busy"] = c["wall_over_cpu"] > typical + margin
    return [c for c in cells if c.get("host_busy")]


def group_ready_step(records: list[Record], R: float, P: float) -> float:
    """Eq. 14 for one update with each source released at its group's last arrival (GRPO)
    or its trajectory's last turn (OPD); replay/prefix work keeps its own release time."""
    unit = lambda s: s.traj_id if s.source == "turn" else s.group_id  # noqa: E731
    last: dict[str, float] = {}
    for s in trace.sources(records):
        last[unit(s)] = max(last.get(unit(s), 0.0), s.ready)
    lanes: dict[int, list] = {}
    for e in trace.work(records):
        release = last[unit(e)] if isinstance(e, SourceRecord) else e.ready
        lanes.setdefault(e.rank, []).append((release, e.end - e.start))
    return max(predict.replay_lane(jobs, R, P) for jobs in lanes.values())



def async_predicted(schedule: str, played: list[dict], by_update: dict, pred: dict,
                    P: float) -> list[float]:
    """Predicted step times of an asynchronous schedule's measured (steady) updates.
    one_step_off: each segment's traces through predict.one_step_off_segment; fully_async:
    predict.one_step_off_period with R the stream's time per batch when nothing holds it
    back (the mean group duration: G slots). P: the suffix (reduction,
    optimizer step, publication) of the cell's sync updates, the same work."""
    segments: list[list[dict]] = []
    for r in played:
        if r["schedule"] == schedule and not r["calibration"] and not r["warmup"]:
            if r["seg"] == 0:
                segments.append([])
            segments[-1].append(r)
    out = []
    for seg in segments:
        ups = [r["policy_version"] for r in seg]
        if schedule == "one_step_off":
            steps = predict.one_step_off_segment(
                [(pred[u]["R"], predict.jobs_by_rank(by_update.get(u, [])), P) for u in ups])
        else:  # the stream's own pace, not the interval it showed (the bound held it back)
            steps = [predict.one_step_off_period(r["R_stream_s"],
                                                 pred[r["policy_version"]]["L"], P)
                     for r in seg]
        out += [t for t, r in zip(steps, seg) if r["steady"]]
    return out


def policy_lag(rows: list[dict]) -> dict:
    """policy_lag_mean (over scored tokens) and policy_lag_max of the measured updates: the
    learner's figures where its metrics carry them, else what the simulator sent."""
    if rows and all("policy_lag_mean" in r for r in rows):
        tokens = [max(1, r.get("scored_tokens") or 1) for r in rows]
        lag = sum(r["policy_lag_mean"] * n for r, n in zip(rows, tokens)) / sum(tokens)
        return dict(policy_lag_mean=lag, policy_lag_max=max(r["policy_lag_max"] for r in rows),
                    policy_lag_from="learner")
    sent = [x for r in rows for x in r["sent_lag"]]
    tokens = sum(n for _, n in sent)
    return dict(policy_lag_mean=sum(lag * n for lag, n in sent) / tokens if tokens else 0.0,
                policy_lag_max=max((lag for lag, _ in sent), default=0),
                policy_lag_from="simulator")
