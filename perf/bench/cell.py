"""Trace-driven overlap benchmark: same update, shorter step — measured on this machine.

A rollout simulator plays the paper's completion-time model and delivers real sources
(real token sequences) through the real readiness channel to the real learner (Megatron
model, 2 gloo ranks, one thread each). Trajectory i completes at τ_i = U_i·R with
U_i ~ Uniform(0, 1); its length (and so its learner service) grows as U_i^γ; GRPO groups
have m members; OPD trajectories release `turns` turns spread over their lifetime. The
simulator sleeps: it does not compete for the learner's cores. `RecordedWorkload` replays a
real run's release trace instead (recorded completion fractions, lengths, groups, turns).

One learner launch per cell (objective, r, B). It serves every draw (random batch) once
with all sources ready at once (sync, R = 0) to measure L, the busiest rank's learner time
for that batch, and sets R = r·L per draw. It plays a warm-up round (not measured: the
first update of a schedule in a process ran up to 1.6× a later one), then `rounds` rounds; in
each, the schedules run the same draw back to back, in an order rotated every round,
switched per batch through RegisterBatch. The asynchronous ones (one_step_off, fully_async)
play a segment of consecutive updates under their live protocol (docs/design/async.md), the
rollout's decisions in async_rollout.py; only the segment's steady-state updates count.
Pairing them in time matters on a shared machine: runs of identical code launched minutes
apart differed by up to 15 % here, updates one second apart by a few %. Speedup = mean step time of `sync` / mean step
time of the schedule; the predicted speedup replays the schedule's own traces through
Eq. 14 (tsync_mcore.observability.predict; the asynchronous schedules through its one_step_off model).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from statistics import mean, median, stdev

from tsync_mcore.channel import Hello, load_or_create_secret, open_rollout_side
from tsync_mcore.learner.schedule import ASYNC_SCHEDULES
from tsync_mcore.observability import predict, trace
from tsync_mcore.observability.trace import Record, UpdateRecord
from tsync_mcore.util.net import free_port

from perf import ROOT
from perf.bench import analysis as an
from perf.bench.plan import PACK_DEFAULT, SCHEDULES, plan_steps, segment_at
from perf.bench.simulator import ack, play, play_fully_async, play_one_step_off
from perf.bench.workload import RecordedWorkload, Workload


@dataclass
class HostSetup:
    """How the learner ranks, the simulated rollout and the channel share this host's cores
    (in a deployment the rollout and its channel run on other hosts and cores).

    batch_sched: learners under SCHED_BATCH, so a woken thread does not preempt one
    mid-kernel. realtime_io: the simulator's thread and every channel thread (gloo I/O,
    readers, both sides) under SCHED_FIFO, so a release goes out on time and is received at
    once instead of waiting for a busy learner's time slice (without it, releases of the
    streaming schedules lagged their model times by a median 2-17 ms and up to 230 ms, and
    the last one stretched R by up to 12 %; each I/O wake-up runs ~1 ms). pin: learner
    rank i on core i (with its threads), so the scheduler does not migrate a learner
    between cores (serving wall/CPU 1.06-1.09 → 1.05-1.07)."""
    batch_sched: bool = True
    realtime_io: bool = True
    pin: bool = True



def run_cell(hf_dir: str, run_dir: str, work: Workload | RecordedWorkload, ratio: float, rounds: int,
             warmup: int = 1, k_open: int | None = None, host: HostSetup = HostSetup(),
             routing: str = "balanced", schedules: tuple[str, ...] = SCHEDULES,
             max_staleness: int = 1, max_tokens_per_pass: int = PACK_DEFAULT,
             minibatches: int = 1) -> list[dict]:
    """Launch 2 learner ranks, play the cell's updates, return the metrics rows (each with
    the Step that produced it, its R and the simulator's release lag). `minibatches`:
    learner.minibatches, PPO mini-batch steps per update (every schedule of the cell).

    k_open defaults to every group a rank can hold (under balanced routing, any group of
    the batch): a tighter cap holds back sources of new groups until open ones close,
    which on small batches turns into learner tail."""
    steps = plan_steps(rounds, warmup, schedules)
    if k_open is None:
        n_groups = max(len(work.update(0, 1.0, draw=s.draw)[0].groups) for s in steps)
        k_open = n_groups if routing == "balanced" else -(-n_groups // 2)
    own_policy = os.sched_getscheduler(0), os.sched_getparam(0)
    if host.batch_sched:
        # Threads and processes started from here on inherit it: the learners.
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    port = free_port()
    shutil.rmtree(run_dir, ignore_errors=True)  # the learner appends to metrics and traces
    os.makedirs(run_dir)
    secret = load_or_create_secret(os.path.join(run_dir, "channel.secret"))  # the learner's too
    sets = [f"model.hf_dir={hf_dir}", f"run.dir={run_dir}", f"run.updates={len(steps)}",
            "run.save_every=0", f"publish.dir={run_dir}/publish", f"channel.port={port}",
            "publish.method=file",  # the scripted rollout reads the published file
            f"learner.objective={work.objective}", f"learner.k_open={k_open}",
            "channel.timeout_s=300", f"channel.realtime_io={str(host.realtime_io).lower()}",
            f"learner.max_staleness={max_staleness}",
            # packed serving: the sync baseline packs its sources into micro-batches as a
            # verl/slime learner does, so every speedup is over that baseline
            f"learner.max_tokens_per_pass={max_tokens_per_pass}",
            f"learner.minibatches={minibatches}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one core per learner rank
    learner = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--monitor-interval", "1",  # the agent's 0.1 s default polling takes a learner core
         "--master-port", str(free_port()), os.path.join(ROOT, "launch/learner.py"),
         "--config", os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"), "--set", *sets],
        cwd=ROOT, env=env, stdout=open(os.path.join(run_dir, "learner.out"), "w"),
        stderr=open(os.path.join(run_dir, "learner.err"), "w"))
    if host.realtime_io:  # this thread releases the sources; its links' threads inherit
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    # As in the learner (run.gc_every): no automatic full GC pass mid-batch (one walks every
    # object torch imported, ~0.1-0.3 s here, at real-time priority on a learner's core);
    # one pass between batches instead.
    gc.collect()
    gc.freeze()
    gc.disable()
    links = open_rollout_side("127.0.0.1", port, 2, timeout_s=300, realtime_io=host.realtime_io,
                              secret=secret)
    L: dict[int, float] = {}  # draw → busiest rank's learner time, from its calibration update
    v_of_calibration: dict[int, int] = {}
    played: list[dict] = []  # per update: R_s, sim_cpu_s, release_lag_s, sent_lag, …
    try:
        assert isinstance(links[0].recv(), Hello)
        if host.pin:  # every learner thread exists by now (later ones inherit the mask)
            _pin_workers(learner.pid)
        ack(links[0], 0)
        v = 0
        while v < len(steps):
            step = steps[v]
            if not step.calibration:
                if step.draw not in L:
                    v_cal = v_of_calibration[step.draw]
                    L[step.draw] = an.busiest_lane(_wait_for_trace(run_dir, v_cal), v_cal)
                R = ratio * L[step.draw]
            else:
                R = 0.0
                v_of_calibration[step.draw] = v
            if step.schedule in ASYNC_SCHEDULES:
                seg = segment_at(steps, v)
                play_segment = play_one_step_off if step.schedule == "one_step_off" else \
                    partial(play_fully_async, max_staleness=max_staleness)
                played += play_segment(links, work, v, seg, R, routing)
                v += len(seg)
                gc.collect()  # the learners are in the segment's last optimizer step
                continue
            cpu0 = time.process_time()
            lag, sent = play(links, work, v, step, R, routing)
            played.append(dict(R_s=R, sim_cpu_s=time.process_time() - cpu0, release_lag_s=lag,
                               sent_lag=sent, dropped_stale_groups=0))
            gc.collect()  # the learners are in their optimizer step
            ack(links[0], v + 1)
            v += 1
        learner.wait(timeout=300)
    finally:
        for link in links:
            link.close()
        if learner.poll() is None:
            learner.kill()
        os.sched_setscheduler(0, *own_policy)
        gc.enable()
        gc.unfreeze()
    if learner.returncode != 0:
        raise RuntimeError(f"learner failed ({learner.returncode}); see {run_dir}/learner.err")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for row, step, sim in zip(rows, steps, played):
        assert row["schedule"] == step.schedule, (row["schedule"], step)
        # sim_cpu_s: CPU the simulator spent sending this batch, taken from the learners'
        # two cores (a real rollout runs elsewhere). release_lag_s: per source, how long after
        # its model time its send completed (the learner had taken it off the wire).
        # sent_lag: (policy lag, scored tokens) per source as the simulator sent it.
        row.update(draw=step.draw, calibration=step.calibration, warmup=step.warmup,
                   seg=step.seg, steady=step.steady, **sim)
    return rows



def _pin_workers(agent_pid: int) -> None:
    """Every thread of the learner worker with LOCAL_RANK=i onto core i (mod cores)."""
    cores = sorted(os.sched_getaffinity(0))
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            core = cores[int(env[b"LOCAL_RANK"]) % len(cores)]
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), {core})
        except (OSError, ValueError, KeyError, IndexError):
            continue  # gone meanwhile, or not a worker


def _wait_for_trace(run_dir: str, update: int, timeout_s: float = 60.0) -> list[Record]:
    """Both ranks write an update's trace right after its publication; wait for them (a
    rank's UpdateRecord is its last record of the update)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = trace.read_run(run_dir)  # a line still being written is skipped
        if {r.rank for r in records if isinstance(r, UpdateRecord) and r.update == update} \
                == {0, 1}:
            return records
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run_dir}: no trace of update {update} from both ranks")
        time.sleep(0.01)


def cell(hf_dir: str, out_dir: str, objective: str, ratio: float, batch: int,
         rounds: int, warmup: int = 1, host: HostSetup = HostSetup(), routing: str = "balanced",
         recorded: RecordedWorkload | None = None, schedules: tuple[str, ...] = SCHEDULES,
         max_staleness: int = 1, max_tokens_per_pass: int = PACK_DEFAULT,
         minibatches: int = 1, **workload) -> list[dict]:
    """The schedules at one (objective, ratio, batch), paired round by round.
    `workload`: other Workload fields (lengths, group size, turns); `recorded`: replay a
    real run's release trace instead (its objective and batch override the arguments)."""
    if recorded is not None:
        work, objective, batch = recorded, recorded.objective, recorded.batch
    else:
        work = Workload(objective=objective, batch=batch, **workload)
    schedules = tuple(s for s in SCHEDULES if s in schedules)  # sync first: speedups over it
    tag = "-recorded" if recorded is not None else ""
    mb = f"-m{minibatches}" if minibatches > 1 else ""
    d = os.path.join(out_dir, f"{objective}-r{ratio}-b{batch}{tag}{mb}")
    played = run_cell(hf_dir, d, work, ratio, rounds, warmup, host=host, routing=routing,
                      schedules=schedules, max_staleness=max_staleness,
                      max_tokens_per_pass=max_tokens_per_pass, minibatches=minibatches)
    rows = [r for r in played if not r["calibration"] and not r["warmup"] and r["steady"]]
    pred = {u["update"]: u for u in predict.analyze_run(d, warmup=0)["updates"]}
    entries = trace.read_run(d)
    by_update: dict[int, list[Record]] = {}
    for e in trace.work(entries):
        by_update.setdefault(e.update, []).append(e)
    # L: the learner time the sync updates took (R was set from their calibration twins)
    L_sync = mean(an.busiest_lane(by_update[r["policy_version"]], r["policy_version"])
                  for r in rows if r["schedule"] == "sync")
    sync_rows = [r for r in rows if r["schedule"] == "sync"]
    P_sync = mean(pred[r["policy_version"]]["P"] for r in sync_rows)
    out = []
    for schedule in schedules:
        mine = [r for r in rows if r["schedule"] == schedule]
        ups = [r["policy_version"] for r in mine]
        # The counterfactual of every schedule: the paired sync updates of the same draws,
        # replayed from their own trace (packed passes). The paper's Eq. 16 instead puts the
        # schedule's own service times into T_sync = R + L + P, which assumes a source costs
        # the same streamed as in sync's packed pass; that speedup, `speedup_same_service`,
        # is kept beside it (measured over it: what packing's efficiency is worth here).
        t_sync_pred = mean(pred[r["policy_version"]]["T_sync"] for r in sync_rows)
        t_same_service = (mean(pred[u]["T_sync"] for u in ups)
                          if schedule not in ASYNC_SCHEDULES else None)
        if schedule == "sync":
            t_pred = t_sync_pred
        elif schedule == "thundersync":
            t_pred = mean(pred[u]["T_thundersync"] for u in ups)
        elif schedule == "group_ready":
            t_pred = mean(an.group_ready_step(by_update[u], pred[u]["R"], pred[u]["P"]) for u in ups)
        else:
            t_pred = mean(an.async_predicted(schedule, played, by_update, pred, P_sync))
        # per round (draw): the schedule's mean step (an asynchronous one plays several)
        per_draw = {}
        for r in mine:
            per_draw.setdefault(r["draw"], []).append(r["step_wall_time_s"])
        out.append(dict(
            objective=objective, schedule=schedule, ratio=ratio, batch=batch, rounds=rounds,
            routing=routing if objective == "grpo" else "static",
            max_tokens_per_pass=max_tokens_per_pass,  # 0: one source per pass
            minibatches=minibatches,  # PPO mini-batch steps per update
            packed_share=an.packed_share(entries, set(ups)),
            workload="recorded" if recorded is not None else "model",
            R_s=mean(r["R_s"] for r in mine), L_s=L_sync,
            # R over the learner time the sync updates actually took (noise shows here);
            # fully_async: its rollout time per batch of completed groups
            ratio_effective=mean(r["R_s"] for r in mine) / L_sync,
            step_time_s=mean(r["step_wall_time_s"] for r in mine),
            step_times_s=[mean(x) for x in per_draw.values()],
            steady_updates=len(mine),
            learner_tail_s=mean(r["learner_tail_s"] for r in mine),
            mfu_active=mean(r["mfu_active"] for r in mine),
            sim_cpu_s=mean(r["sim_cpu_s"] for r in mine),
            # the simulated rollout's fidelity: sends completed this long after model time
            release_lag_ms=1e3 * median(x for r in mine for x in r["release_lag_s"]),
            release_lag_max_ms=1e3 * max(x for r in mine for x in r["release_lag_s"]),
            host=asdict(host),
            # CPU: process-lifetime RSS of the cell's learner (ru_maxrss cannot be reset)
            peak_mem_bytes=max(r["peak_mem_bytes"] for r in mine),
            accum_peak_bytes=max(r["accum_peak_bytes"] for r in mine),
            speedup_predicted=t_sync_pred / t_pred,
            speedup_same_service=t_same_service / t_pred if t_same_service else None,
            step_time_predicted_s=t_pred,
            prediction_error_pct=100.0 * (t_pred - mean(r["step_wall_time_s"] for r in mine))
            / mean(r["step_wall_time_s"] for r in mine) if schedule != "group_ready" else None,
            **an.policy_lag(mine),
            dropped_stale_groups=sum(r["dropped_stale_groups"] for r in mine),
            # only a streaming lane goes idle between arrivals, where the cost shows alone
            **an.dispatch_fields(entries, set(ups), schedule == "thundersync"),
            # serving wall time over the serving thread's CPU time: > 1 where the core or
            # the GIL was elsewhere (channel, simulator); CPU time itself shows cache effects
            wall_over_cpu=an.wall_over_cpu(entries, set(ups)),
            wall_over_cpu_arriving=an.wall_over_cpu(
                entries, set(ups), {r["policy_version"]: r["rollout_time_s"] for r in mine}),
            **an.paired_service(by_update, mine, sync_rows),
            serve_cpu_s=an.serve_cpu(entries, set(ups)),
            run_dir=d))
    sync_t = out[0]["step_time_s"]
    for c in out:
        c["speedup_measured"] = sync_t / c["step_time_s"]
        c["measured_over_predicted"] = c["speedup_measured"] / c["speedup_predicted"]
        # spread: the same batch's sync step over this schedule's step, round by round
        per_round = [a / b for a, b in zip(out[0]["step_times_s"], c["step_times_s"])]
        c["speedup_per_round"] = per_round
        c["speedup_stderr"] = stdev(per_round) / len(per_round) ** 0.5 if len(per_round) > 1 else None
    return out
