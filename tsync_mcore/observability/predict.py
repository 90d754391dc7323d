"""Speedup predictor (ThunderSyncRL paper §4.4, appendix F; docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report).

Two independent predictors:

* **Trace replay** (Eq. 14-17, F.4/F.5). Each learner rank is one lane; its jobs are served
  in readiness order, ``c_j = max(τ_j, c_{j-1}) + p_j`` and ``T = max(R, c_n) + P`` (Eq. 14).
  Statically assigned ranks are replayed separately and the latest completion wins. Sync
  releases everything at batch close: ``T_sync = R + L + P`` (Eq. 16), and
  ``S = (1+ρ+κ)/(1+λ+κ) ≤ 2`` (Eq. 16-17).
* **Asynchronous schedules** (docs/design/async.md). one_step_off overlaps the learner of batch k
  with the rollout of batch k+1, so in steady state the step time is the slower pipeline,
  ``T = max(R + reload, L + P)`` (``one_step_off_period``); ``one_step_off_segment`` plays
  a segment's traces through the same lanes as Eq. 14, with each batch's rollout starting
  when the previous one closed and its sampling policy was published, and each update
  starting when the learner published the previous one. fully_async (a batch worth of
  completed groups per step) is modelled by the same bound with R its rollout time per batch.
* **Analytic release laws** (Eq. 19-28). GRPO ``F(u) = (1-β)u^{γ+1} + βu^{γ+m}`` (Eq. 22),
  OPD Eq. 24, the tail of Eq. 19 and the successive-wave speedup of Eq. 26 with the
  plotting approximation of Eq. 28 (defaults of the paper's appendix F.5).

Names (one meaning each, in the output keys, the flags and docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report):

* ``ratio`` r = R / L: rollout time over learner time (the learner's work of the update, on
  its busiest rank). ``predict trace`` reports it per update and for the steady state
  (``ratio``: mean R over mean L); ``predict analytic --ratio`` takes it; perf/ sweeps it.
* ``rho`` ρ = L / R = 1/r: the paper's learner load (Eq. 16); ``rho_w`` is the same per
  rollout wave in the analytic model.

CLI::

    python -m tsync_mcore.observability.predict trace RUN_DIR [--warmup N] [--suffix full|publish] [--json]
    python -m tsync_mcore.observability.predict analytic --objective grpo|opd --batch B --ratio r --turns a
        [--group-size m --beta β --delta δ --gamma γ --capacity Q --suffix κ_w]
        [--peak] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

from tsync_mcore.observability import trace
from tsync_mcore.observability.trace import DeferredRecord, Record

Job = tuple[float, float]  # (τ_j ready time, p_j service time), seconds from the update start

# --------------------------------------------------------------------------------------------
# Trace replay (Eq. 14-17)
# --------------------------------------------------------------------------------------------


def lane_completion(jobs: Iterable[Job]) -> float:
    """Endpoint ``c_n`` of one learner lane (Eq. 14): ``c_j = max(τ_j, c_{j-1}) + p_j``, c_0 = 0.

    Jobs are served in nondecreasing readiness order; the sort is stable, so jobs with equal
    τ keep the order given (callers use this to put a trajectory's deferred work after its
    last turn)."""
    c = 0.0
    for tau, p in sorted(jobs, key=lambda j: j[0]):
        c = max(tau, c) + p
    return c


def lane_completion_closed_form(jobs: Iterable[Job]) -> float:
    """Eq. 15: ``c_n = max_j (τ_j + Σ_{i≥j} p_i)`` in readiness order (equal to Eq. 14)."""
    ordered = sorted(jobs, key=lambda j: j[0])
    best, suffix = 0.0, 0.0
    for tau, p in reversed(ordered):
        suffix += p
        best = max(best, tau + suffix)
    return best


def replay_lane(jobs: Iterable[Job], R: float, P: float) -> float:
    """ThunderSyncRL step time of one lane, ``T = max(R, c_n) + P`` (Eq. 14)."""
    return max(R, lane_completion(jobs)) + P


def jobs_by_rank(records: Iterable[Record]) -> dict[int, list[Job]]:
    """Learner jobs per rank from the trace records of one update (docs/design/trace.md).

    ``p_j = end - start`` and ``τ_j = ready``. An OPD replay (deferred work, paper appendix F.2
    δ) becomes ready when its trajectory completes, i.e. at the latest ready time of that
    trajectory's turns on the rank; it is ordered after those turns. Sources that were
    never served carry no learner work and are skipped."""
    records = list(records)
    last_turn: dict[tuple[int, str], float] = {}
    for s in trace.sources(records):
        if s.source == "turn":
            key = (s.rank, s.traj_id)
            last_turn[key] = max(last_turn.get(key, -math.inf), s.ready)
    keyed: dict[int, list[tuple[float, int, int, float]]] = defaultdict(list)
    for idx, r in enumerate(records):
        if not r.served:
            continue
        p = max(0.0, r.end - r.start)
        if isinstance(r, DeferredRecord) and r.work == "replay":
            tau = last_turn.get((r.rank, r.traj_id), r.ready)
            keyed[r.rank].append((tau, 1, idx, p))
        else:
            keyed[r.rank].append((r.ready, 0, idx, p))
    return {r: [(tau, p) for tau, _, _, p in sorted(js)] for r, js in sorted(keyed.items())}


def _ratio(x: float, R: float) -> float | None:
    return x / R if R > 0 else None


def predict_update(records: Iterable[Record], R: float, P: float,
                   step_s: float = 0.0) -> dict[str, Any]:
    """Predicted ThunderSyncRL and Sync step times of one update from its trace (Eq. 14-17).

    Each rank is its own lane (F.4: a pooled rate can miss a slow rank); the latest endpoint
    determines ``T_thundersync = max(R, max_r c_n^r) + P``. Sync releases every job at batch
    close, ``T_sync = R + max_r L_r + P`` (Eq. 16). A job stamped ready after R (the learner
    stamps readiness on receipt, which waits while it serves an earlier job) delays the
    ThunderSyncRL lane only through Eq. 14 and is available to Sync at close, as R is by
    definition the last rollout event (F.1). Returns the times, ``ratio = R/L``, ``ρ = L/R``, ``κ = P/R``,
    ``λ = [c_n - R]_+/R`` and ``S = T_sync/T = (1+ρ+κ)/(1+λ+κ) ≤ 2`` (Eq. 16-17).

    PPO mini-batches (learner.minibatches m > 1): Eq. 14 covers mini-batch 1 (and the later
    sources' old-log-prob forwards, served as they arrive); mini-batches 2..m run after it
    on every schedule, each after an optimizer step of `step_s`: both times gain
    ``Σ_{j≥2} (step_s + L_j)``, L_j the busiest rank's service of mini-batch j."""
    records = list(records)
    later: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in trace.sources(records):
        if r.minibatch > 1 and r.served:
            later[r.minibatch][r.rank] += max(0.0, r.end - r.start)
    lanes = jobs_by_rank(r for r in records
                         if not (isinstance(r, trace.SourceRecord) and r.minibatch > 1))
    ends = {r: lane_completion(js) for r, js in lanes.items()}
    loads = {r: sum(p for _, p in js) for r, js in lanes.items()}
    c_n = max(ends.values(), default=0.0)
    L_first = max(loads.values(), default=0.0)
    tail_mb = sum(step_s + max(by_rank.values()) for by_rank in later.values())
    L = L_first + sum(max(by_rank.values()) for by_rank in later.values())
    t_ts = max(R, c_n) + tail_mb + P
    t_sync = R + L_first + tail_mb + P
    slow = max(ends, key=lambda r: ends[r]) if ends else None
    return dict(
        T_thundersync=t_ts, T_sync=t_sync, speedup=t_sync / t_ts if t_ts > 0 else None,
        R=R, P=P, L=L, L_total=sum(loads.values()), c_n=c_n, tail_s=max(0.0, c_n - R),
        ratio=R / L if L > 0 else None, rho=_ratio(L, R), kappa=_ratio(P, R), lam=_ratio(max(0.0, c_n - R), R),
        n_jobs=sum(len(js) for js in lanes.values()), ranks=sorted(lanes), slow_rank=slow,
        minibatch_tail_s=tail_mb,
        lane_end={str(r): c for r, c in ends.items()},
        lane_load={str(r): x for r, x in loads.items()})


# --------------------------------------------------------------------------------------------
# Asynchronous schedules (one_step_off, fully_async)
# --------------------------------------------------------------------------------------------

ASYNC = ("one_step_off", "fully_async")


def one_step_off_period(R: float, L: float, P: float, reload: float = 0.0) -> float:
    """Steady-state step time of one_step_off: the rollout of batch k+1 (R, then the reload
    of θ_{k+1}) runs while the learner trains batch k (L, then P: reduction, optimizer step,
    publication), so the period is the slower of the two, ``max(R + reload, L + P)``."""
    return max(R + reload, L + P)


def one_step_off_segment(batches: Sequence[tuple[float, dict[int, list[Job]], float]],
                         reload: float = 0.0) -> list[float]:
    """Step times (publication to publication) of a one_step_off segment from its traces.

    ``batches[i] = (R_i, lanes_i, P_i)``: batch i's rollout time, its learner jobs per rank
    (τ from the batch's registration, as the trace records them) and its suffix. Batch 0 is
    sampled with θ_{v0} (loaded at time 0), batch i ≥ 1 with θ_{v0+i−1}: its rollout starts
    when batch i−1 closed and, for i ≥ 2, θ_{v0+i−1} was published, plus its reload. Update i
    starts when the learner published θ_{v0+i} (update 0: at 0); each lane runs Eq. 14 from
    then on, and the step waits for the batch's close: ``pub_{i+1} = max(close_i, c_n) + P_i``.
    In steady state this is ``one_step_off_period``; the traces add what the lanes show
    (a rank's imbalance, sources that arrive after the learner caught up)."""
    pub, close = [0.0], 0.0
    for i, (R, lanes, P) in enumerate(batches):
        # between two batches the rollout reloads θ_{v0+i−1} (waiting for it if need be)
        start = close if i < 2 else max(close, pub[i - 1]) + reload
        close = start + R
        end = close
        for jobs in lanes.values():
            c = pub[i]
            for tau, p in sorted(jobs, key=lambda j: j[0]):
                c = max(start + tau, c) + p
            end = max(end, c)
        pub.append(end + P)
    return [pub[i + 1] - pub[i] for i in range(len(batches))]


def async_speedup(ratio: float, kappa: float = 0.0, waves: float = 1.0) -> float:
    """one_step_off over Sync in the analytic model's units (R = w, L = w/r, P = κ):
    ``[w(1 + 1/r) + κ] / max(w, w/r + κ)``."""
    rho = 1.0 / ratio
    return (waves * (1.0 + rho) + kappa) / max(waves, waves * rho + kappa)


# --------------------------------------------------------------------------------------------
# Run directories (metrics.jsonl + traces/rank{R}.jsonl)
# --------------------------------------------------------------------------------------------


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_traces(run_dir: str) -> dict[int, list[Record]]:
    """All trace records of a run (traces/rank*.jsonl), keyed by update."""
    by_update: dict[int, list[Record]] = defaultdict(list)
    for rec in trace.read_run(run_dir):
        by_update[rec.update].append(rec)
    return dict(by_update)


def infer_step_time(row: dict[str, Any], last_end: float) -> float:
    """Reduction + optimizer time, inferred as ``learner_tail_s`` minus the learner work that
    remained after the batch closed (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report). With ``step_wall_time_s`` the
    learner clock of rank 0 gives ``t_stepped = wall - publish`` and ``t_closed = t_stepped - tail`` (the
    close's arrival), so the
    step is ``t_stepped - max(t_closed, last_end)``; without it the close is taken at R."""
    tail = float(row.get("learner_tail_s") or 0.0)
    publish = float(row.get("publish_time_s") or 0.0)
    wall = row.get("step_wall_time_s")
    if wall is not None:
        step = min(tail, float(wall) - publish - last_end)
    else:
        step = tail - max(0.0, last_end - float(row.get("rollout_time_s") or 0.0))
    return min(tail, max(0.0, step))


def _update_of(row: dict[str, Any]) -> int:
    """Trace ``update`` index of a metrics row: its policy version (= step - 1)."""
    if "policy_version" in row:
        return int(row["policy_version"])
    return int(row["step"]) - 1


def analyze_run(run_dir: str, warmup: int = 1, suffix: str = "full") -> dict[str, Any]:
    """Replay every update of RUN_DIR through Eq. 14 and summarise the steady state.

    ``suffix="full"`` uses ``P = publish_time_s + inferred reduction/optimizer time``;
    ``suffix="publish"`` uses ``P = publish_time_s`` only. The steady-state speedup is the
    ratio of mean predicted step times (Eq. 12), after discarding ``warmup`` updates."""
    if suffix not in ("full", "publish"):
        raise ValueError(f"suffix must be 'full' or 'publish', not {suffix!r}")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    if not os.path.exists(metrics_path):
        raise FileNotFoundError(f"{metrics_path} not found (not a run directory?)")
    rows = sorted(_read_jsonl(metrics_path), key=lambda r: int(r["step"]))
    traces = load_traces(run_dir)
    updates: list[dict[str, Any]] = []
    for row in rows:
        records = traces.get(_update_of(row), [])
        R = float(row.get("rollout_time_s") or 0.0)
        last_end = max((r.end for r in trace.work(records)), default=0.0)
        publish = float(row.get("publish_time_s") or 0.0)
        schedule = row.get("schedule")
        # An asynchronous update's wall time runs from the previous publication, not from
        # its registration, and its close may come right after the registration
        # (fully_async): its step is inferred from the tail after its last source arrived.
        last_ready = max((r.ready for r in trace.sources(records)), default=0.0)
        timed = {**row, "step_wall_time_s": None, "rollout_time_s": last_ready} \
            if schedule in ASYNC else row
        step_s = infer_step_time(timed, last_end) if suffix == "full" else 0.0
        pred = predict_update(records, R, publish + step_s, step_s=step_s)
        pred["T_async"] = one_step_off_period(R, pred["L"], pred["P"])
        measured = row.get("step_wall_time_s")
        own = {"thundersync": pred["T_thundersync"], "sync": pred["T_sync"],
               "one_step_off": pred["T_async"], "fully_async": pred["T_async"]}.get(schedule)
        err = 100.0 * (own - measured) / measured if own is not None and measured else None
        updates.append(dict(step=int(row["step"]), update=_update_of(row), schedule=schedule,
                            step_time_measured=measured, publish_s=publish, step_s=step_s,
                            learner_tail_s=row.get("learner_tail_s"),
                            prediction_error_pct=err, **pred))
    if warmup < 0:
        raise ValueError("warmup must be >= 0")
    steady = updates[warmup:]
    if not steady:
        raise ValueError(f"{run_dir}: {len(updates)} updates, none left after --warmup {warmup}")

    def mean(key: str) -> float | None:
        vals = [u[key] for u in steady if u[key] is not None]
        return sum(vals) / len(vals) if vals else None

    t_ts, t_sync = mean("T_thundersync"), mean("T_sync")
    mean_L = mean("L")
    errs = [u["prediction_error_pct"] for u in steady if u["prediction_error_pct"] is not None]
    return dict(
        run_dir=run_dir, warmup=warmup, suffix=suffix, n_updates=len(updates),
        n_steady=len(steady), updates=updates,
        step_time_measured_mean=mean("step_time_measured"),
        T_thundersync_mean=t_ts, T_sync_mean=t_sync,
        speedup_predicted=t_sync / t_ts if t_ts else None,
        speedup_per_update_mean=mean("speedup"),
        ratio=mean("R") / mean_L if mean_L else None,  # r = R/L: `analytic --ratio`
        rho_mean=mean("rho"), kappa_mean=mean("kappa"), lam_mean=mean("lam"),
        prediction_error_pct_mean=sum(errs) / len(errs) if errs else None)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_run(res: dict[str, Any]) -> str:
    """Human-readable per-update table and steady-state summary."""
    head = (f"{'step':>5} {'sched':>11} {'measured':>9} {'R':>8} {'L':>8} {'P':>7} "
            f"{'tail':>7} {'T_tsync':>9} {'T_sync':>9} {'S':>6} {'slow':>4} {'err%':>6}")
    lines = [head]
    for i, u in enumerate(res["updates"]):
        mark = "*" if i < res["warmup"] else " "
        lines.append(
            f"{u['step']:>4}{mark} {str(u['schedule']):>11} {_fmt(u['step_time_measured']):>9} "
            f"{u['R']:>8.3f} {u['L']:>8.3f} {u['P']:>7.3f} {u['tail_s']:>7.3f} "
            f"{u['T_async' if u['schedule'] in ASYNC else 'T_thundersync']:>9.3f} "
            f"{u['T_sync']:>9.3f} {_fmt(u['speedup']):>6} "
            f"{str(u['slow_rank']):>4} {_fmt(u['prediction_error_pct'], '.1f'):>6}")
    extra = " + reduction/optimizer" if res["suffix"] == "full" else ""
    lines.append(f"(* = warm-up, discarded; P = publish{extra}; T_tsync of an asynchronous "
                 f"update: max(R, L + P), its steady-state period)")
    lines.append(
        f"steady state over {res['n_steady']} updates: "
        f"measured {_fmt(res['step_time_measured_mean'])} s, "
        f"predicted thundersync {_fmt(res['T_thundersync_mean'])} s, "
        f"sync {_fmt(res['T_sync_mean'])} s, speedup {_fmt(res['speedup_predicted'])}x "
        f"(ratio r = R/L {_fmt(res['ratio'])}, as `predict analytic --ratio` takes it; "
        f"rho = L/R {_fmt(res['rho_mean'])}, kappa = P/R {_fmt(res['kappa_mean'])}, "
        f"lambda = tail/R {_fmt(res['lam_mean'])})")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Analytic release laws (Eq. 19-28)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseParams:
    """Parameters of the analytical sweeps (the paper's appendix F.5)."""

    capacity: float = 128.0  # Q, trajectories per rollout wave
    group_size: int = 8  # m
    beta: float = 0.02  # GRPO closure fraction β
    delta: float = 0.45  # OPD deferred fraction δ
    gamma: float = 0.49  # service exponent γ
    kappa_w: float = 0.05  # suffix P / W


def release_grpo(u: float, m: int, beta: float, gamma: float) -> float:
    """GRPO release fraction ``F(u) = (1-β)u^{γ+1} + βu^{γ+m}`` (Eq. 22)."""
    return (1.0 - beta) * u ** (gamma + 1.0) + beta * u ** (gamma + m)


def release_opd(u: float, turns: int, delta: float, gamma: float) -> float:
    """OPD release fraction (Eq. 24):
    ``F(u) = (1-δ)/a Σ_{j=1..a} min(1, au/j)^{γ+1} + δ u^{γ+1}``."""
    a = turns
    s = sum(min(1.0, a * u / j) ** (gamma + 1.0) for j in range(1, a + 1))
    return (1.0 - delta) / a * s + delta * u ** (gamma + 1.0)


def _sup_tail(rho: float, candidates: Iterable[float], F: Callable[[float], float]) -> float:
    """``λ = max(1, sup_u u + ρ(1 - F(u))) - 1`` (Eq. 19) over the given candidate points."""
    best = max(1.0, max(u + rho * (1.0 - F(u)) for u in candidates))
    return best - 1.0


def _bisect_increasing(f: Callable[[float], float], lo: float, hi: float,
                       iters: int = 200) -> float:
    """Root of an increasing function on [lo, hi] with f(lo) ≤ 0 ≤ f(hi)."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < 0.0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-16:
            break
    return 0.5 * (lo + hi)


def tail_grpo(rho: float, m: int = 8, beta: float = 0.02, gamma: float = 0.49) -> float:
    """Normalized learner tail λ of the GRPO release law (Eq. 19 with Eq. 22).

    ``F`` is convex, so ``u - ρF(u)`` is concave: zero tail when ``ρ[γ+1+β(m-1)] ≤ 1``,
    otherwise the interior maximum solves Eq. 23
    ``(1-β)(γ+1)u^γ + β(γ+m)u^{γ+m-1} = 1/ρ`` (or sits at an endpoint)."""
    if rho <= 0.0:
        return 0.0
    if rho * (gamma + 1.0 + beta * (m - 1)) <= 1.0:
        return 0.0

    def eq23(u: float) -> float:
        return ((1.0 - beta) * (gamma + 1.0) * u ** gamma
                + beta * (gamma + m) * u ** (gamma + m - 1.0) - 1.0 / rho)

    cands = [0.0, 1.0]
    if eq23(0.0) < 0.0:
        cands.append(_bisect_increasing(eq23, 0.0, 1.0))
    return _sup_tail(rho, cands, lambda u: release_grpo(u, m, beta, gamma))


def tail_opd(rho: float, turns: int, delta: float = 0.45, gamma: float = 0.49) -> float:
    """Normalized learner tail λ of the OPD release law (Eq. 19 with Eq. 24), exact.

    On ``[k/a, (k+1)/a]`` the first k turn blocks are fully released and
    ``F(u) = (1-δ)/a [k + S_k (au)^{γ+1}] + δu^{γ+1}`` with ``S_k = Σ_{j>k} j^{-(γ+1)}``,
    convex, so ``u - ρF(u)`` is concave per piece with its stationary point at
    ``u* = (ρC_k)^{-1/γ}``, ``C_k = (γ+1)[(1-δ)a^γ S_k + δ]``. The supremum is the best of
    the piece endpoints and the in-piece stationary points."""
    a = int(turns)
    if a < 1:
        raise ValueError("OPD needs at least one turn")
    if rho <= 0.0:
        return 0.0
    g1 = gamma + 1.0
    suffix = [0.0] * (a + 1)  # suffix[k] = S_k = Σ_{j=k+1..a} j^{-(γ+1)}
    for j in range(a, 0, -1):
        suffix[j - 1] = suffix[j] + j ** (-g1)

    def F(u: float, k: int) -> float:
        return (1.0 - delta) / a * (k + suffix[k] * (a * u) ** g1) + delta * u ** g1

    best = 1.0  # u = 1
    for k in range(a):
        lo, hi = k / a, (k + 1) / a
        cands = [lo, hi]
        C = g1 * ((1.0 - delta) * a ** gamma * suffix[k] + delta)
        if gamma > 0.0 and rho * C > 0.0:
            u_star = (rho * C) ** (-1.0 / gamma)
            if lo < u_star < hi:
                cands.append(u_star)
        best = max(best, max(u + rho * (1.0 - F(u, k)) for u in cands))
    return best - 1.0


def speedup_waves(rho_w: float, lam_w: float, kappa_w: float, waves: float) -> float:
    """Eq. 26: ``S(w) = [w(1+ρ_w) + κ_w] / [w·max(1,ρ_w) + κ_w - [ρ_w-1]_+ + λ_w]``."""
    w = waves
    num = w * (1.0 + rho_w) + kappa_w
    den = w * max(1.0, rho_w) + kappa_w - max(0.0, rho_w - 1.0) + lam_w
    return num / den


def analytic(objective: str, batch: float, ratio: float, turns: int = 1,
             params: ReleaseParams = ReleaseParams()) -> dict[str, Any]:
    """Analytical speedup over Sync (paper appendix F.5/F.6): Eq. 28 maps trajectories per step B
    and the rollout-to-learner ratio r (at full capacity) to ``w = max(1, B/Q)`` waves with
    learner load ``ρ_w = min(1, B/Q)/r``; the tail λ_w comes from Eq. 19 with Eq. 22 (GRPO)
    or Eq. 24 (OPD), and the speedup from Eq. 26."""
    if batch <= 0 or ratio <= 0:
        raise ValueError("batch and ratio must be positive")
    occ = batch / params.capacity
    w = max(1.0, occ)
    rho_w = min(1.0, occ) / ratio
    if objective == "grpo":
        lam = tail_grpo(rho_w, params.group_size, params.beta, params.gamma)
    elif objective == "opd":
        lam = tail_opd(rho_w, turns, params.delta, params.gamma)
    else:
        raise ValueError(f"objective must be 'grpo' or 'opd', not {objective!r}")
    return dict(objective=objective, batch=batch, ratio=ratio, turns=turns,
                params=asdict(params), waves=w, rho_w=rho_w, kappa_w=params.kappa_w, tail=lam,
                speedup=speedup_waves(rho_w, lam, params.kappa_w, w),
                # one_step_off's steady state (lag 1): the same units, no tail
                speedup_one_step_off=async_speedup(ratio / min(1.0, occ), params.kappa_w, w),
                full_overlap_limit=(1.0 + rho_w) / max(1.0, rho_w))


def peak_ratio(objective: str, batch: float, turns: int = 1,
               params: ReleaseParams = ReleaseParams(), lo: float = 0.3,
               hi: float = 4.0, points: int = 741) -> tuple[float, float]:
    """``(r*, S*)``: the rollout-to-learner ratio in [lo, hi] with the largest analytical
    speedup (F.6 sweeps r from 0.3 to 4), by a log-spaced scan refined with golden-section
    search around the best grid point."""
    def s(log_r: float) -> float:
        return analytic(objective, batch, math.exp(log_r), turns, params)["speedup"]

    a, b = math.log(lo), math.log(hi)
    grid = [a + (b - a) * i / (points - 1) for i in range(points)]
    vals = [s(x) for x in grid]
    i = max(range(points), key=vals.__getitem__)
    left, right = grid[max(0, i - 1)], grid[min(points - 1, i + 1)]
    phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = right - phi * (right - left), left + phi * (right - left)
    f1, f2 = s(x1), s(x2)
    for _ in range(60):
        if f1 >= f2:
            right, x2, f2 = x2, x1, f1
            x1 = right - phi * (right - left)
            f1 = s(x1)
        else:
            left, x1, f1 = x1, x2, f2
            x2 = left + phi * (right - left)
            f2 = s(x2)
    x_best, f_best = max([(grid[i], vals[i]), (x1, f1), (x2, f2)], key=lambda t: t[1])
    return math.exp(x_best), f_best


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tsync_mcore.observability.predict", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace", help="replay a run's release traces through Eq. 14")
    t.add_argument("run_dir", help="a run directory (metrics.jsonl and traces/rank*.jsonl)")
    t.add_argument("--warmup", type=int, default=1, help="updates to discard (default 1)")
    t.add_argument("--suffix", choices=("full", "publish"), default="full",
                   help="P = publish + inferred reduction/optimizer time (full) or publish only")
    t.add_argument("--json", action="store_true", help="print every update as JSON")
    d = ReleaseParams()
    a = sub.add_parser("analytic", help="analytical release laws (Eq. 19-28)")
    a.add_argument("--objective", choices=("grpo", "opd"), required=True,
                   help="release law: GRPO (Eq. 22) or OPD turns (Eq. 24)")
    a.add_argument("--batch", type=float, required=True, help="trajectories per step B")
    a.add_argument("--ratio", type=float, default=1.0,
                   help="r = rollout time / learner time (R/L) at full capacity, the `ratio` "
                        "that `predict trace` prints; rho = 1/r (default 1)")
    a.add_argument("--turns", type=int, required=True, help="agentic turns per trajectory a")
    a.add_argument("--group-size", type=int, default=d.group_size,
                   help=f"m, trajectories per GRPO group (default {d.group_size})")
    a.add_argument("--beta", type=float, default=d.beta,
                   help=f"β, GRPO closure fraction (default {d.beta})")
    a.add_argument("--delta", type=float, default=d.delta,
                   help=f"δ, OPD deferred (replay) fraction (default {d.delta})")
    a.add_argument("--gamma", type=float, default=d.gamma,
                   help=f"γ, service exponent of the release law (default {d.gamma})")
    a.add_argument("--capacity", type=float, default=d.capacity,
                   help=f"Q, trajectories per rollout wave (default {d.capacity:g})")
    a.add_argument("--suffix", type=float, default=d.kappa_w,
                   help=f"κ_w = P/W, the step's suffix over a wave's time (default {d.kappa_w})")
    a.add_argument("--peak", action="store_true",
                   help="also report the ratio in [0.3, 4] with the largest speedup")
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "trace":
        try:
            res = analyze_run(args.run_dir, args.warmup, args.suffix)
        except (FileNotFoundError, ValueError) as e:  # TraceError too: one line, no traceback
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(res, indent=1) if args.json else format_run(res))
        return 0
    params = ReleaseParams(capacity=args.capacity, group_size=args.group_size, beta=args.beta,
                           delta=args.delta, gamma=args.gamma, kappa_w=args.suffix)
    res = analytic(args.objective, args.batch, args.ratio, args.turns, params)
    if args.peak:
        r_pk, s_pk = peak_ratio(args.objective, args.batch, args.turns, params)
        res.update(peak_ratio=r_pk, peak_speedup=s_pk)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{args.objective} B={args.batch:g} r={args.ratio:g} a={args.turns}: "
              f"w={res['waves']:.3f} rho_w={res['rho_w']:.4f} tail={res['tail']:.4f} "
              f"speedup={res['speedup']:.4f}x "
              f"(full-overlap limit {res['full_overlap_limit']:.4f}x; "
              f"one_step_off {res['speedup_one_step_off']:.4f}x at policy lag 1)"
              + (f"; peak {res['peak_speedup']:.4f}x at r={res['peak_ratio']:.3f}"
                 if args.peak else ""))
    return 0


if __name__ == "__main__":
    from tsync_mcore.util import quiet
    quiet.install()
    sys.exit(main())
