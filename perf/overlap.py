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
import random
import shutil
import subprocess
import sys
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass, replace
from functools import partial
from statistics import mean, median, stdev

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tsync_mcore.observability import predict  # noqa: E402

from tsync_mcore.observability import trace  # noqa: E402
from tsync_mcore.config import LearnerConfig  # noqa: E402
from tsync_mcore.channel import (Ack, ChannelTimeout, CloseBatch, GroupRewards,  # noqa: E402
                                 Hello, Publish, RegisterBatch, TrajectoryMsg, TurnMsg,
                                 load_or_create_secret, open_rollout_side)
from tsync_mcore.channel.routing import BalancedRouter  # noqa: E402
from tsync_mcore.learner.schedule import ASYNC_SCHEDULES, SYNC_SCHEDULES  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, TrajectorySource, TurnSource, assign_groups  # noqa: E402
from tsync_mcore.observability.trace import Record, SourceRecord, UpdateRecord  # noqa: E402

from async_rollout import FullyAsyncStream, one_step_off_sampler  # noqa: E402
from tsync_mcore.util.net import free_port  # noqa: E402

GAMMA = 0.49  # the paper's service exponent


@dataclass
class Workload:
    objective: str
    batch: int  # trajectories per update
    group_size: int = 4
    turns: int = 4  # OPD
    min_len: int = 24
    max_len: int = 192
    prompt_len: int = 16
    vocab: int = 1024
    seed: int = 42

    def update(self, version: int, R: float, draw: int | None = None) -> tuple[BatchPlan, dict, list]:
        """(plan, n_turns, [(ready_time, source)]) for one update of policy `version`.

        `draw` picks the random batch (default: the version), so several updates can play
        the same batch under different schedules."""
        rng = random.Random(self.seed * 1000 + (version if draw is None else draw))
        plan, n_turns, items = BatchPlan(), {}, []
        groups = self.batch // self.group_size
        for g in range(groups):
            gid = f"v{version}-g{g}"
            prompt = [rng.randrange(self.vocab) for _ in range(self.prompt_len)]
            members = []
            for i in range(self.group_size):
                tid = f"{gid}-t{i}"
                members.append(tid)
                u = rng.random()
                n = self.min_len + int((self.max_len - self.min_len) * u ** GAMMA)
                body = [rng.randrange(self.vocab) for _ in range(n)]
                if self.objective == "grpo":
                    src = TrajectorySource(tid, gid, tuple(prompt + body),
                                           tuple([0] * self.prompt_len + [1] * n), rng.random(),
                                           version, prompt_len=self.prompt_len)
                    items.append((u * R, src))
                else:
                    n_turns[tid] = self.turns
                    items += self._turns(rng, tid, gid, prompt, body, u * R, version)
            plan.add_group(gid, members)
        items.sort(key=lambda x: x[0])
        return plan, n_turns, items

    def _turns(self, rng, tid, gid, prompt, body, done_at, version):
        # Turn j: a few observation tokens, then actions; released at (j+1)/turns of the
        # trajectory's lifetime, with the teacher's scores.
        cuts = [len(body) * (j + 1) // self.turns for j in range(self.turns)]
        out, start, tokens = [], 0, list(prompt)
        prev = 0
        for j, cut in enumerate(cuts):
            acts = body[prev:cut] or [rng.randrange(self.vocab)]
            obs = [rng.randrange(self.vocab) for _ in range(3)]
            span = (prompt + obs + acts) if j == 0 else (obs + acts)
            mask = [0] * (len(span) - len(acts)) + [1] * len(acts)
            teacher = [None if m == 0 else -rng.uniform(0.1, 5.0) for m in mask]
            out.append((done_at * (j + 1) / self.turns, TurnSource(
                tid, gid, j, self.turns, start, tuple(span), tuple(mask), tuple(teacher),
                version, prompt_len=self.prompt_len)))
            start += len(span)
            prev = cut
        return out


class RecordedWorkload:
    """Replays the release trace of a real run instead of the paper's model.

    `from_run(run_dir)` reads a learner run directory (launch/learner.py's `run.dir`:
    traces/rank*.jsonl and metrics.jsonl). Per recorded update it keeps each source's
    completion time as a fraction of that update's rollout time (its `ready` over
    `rollout_time_s`), its token count, scored-token count and shared-prompt length, the
    GRPO groups and, for OPD, every turn. `update(v, R, draw)` plays recorded update
    `draw mod n` at rollout time R. Token ids, rewards and teacher scores are drawn at
    random (the learner's work depends on lengths only); a source's unscored tokens are
    placed first. `token_scale` shrinks lengths, e.g. to replay a GPU run on the CPU model.
    """

    def __init__(self, objective: str, updates: list[dict], vocab: int = 1024, seed: int = 42,
                 token_scale: float = 1.0):
        if not updates:
            raise ValueError("recorded workload: no updates")
        if token_scale <= 0:
            raise ValueError(f"token_scale must be > 0, got {token_scale}")
        self.objective, self.recorded, self.vocab, self.seed = objective, updates, vocab, seed
        self.token_scale = token_scale
        self.batch = max(len(u["trajs"]) for u in updates)

    @classmethod
    def from_run(cls, run_dir: str, vocab: int = 1024, seed: int = 42,
                 token_scale: float = 1.0) -> "RecordedWorkload":
        records = trace.sources(trace.read_run(run_dir))
        if not records:
            raise ValueError(f"{run_dir}: no traces/rank*.jsonl entries to replay")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rollout = {r["policy_version"]: r["rollout_time_s"] for r in map(json.loads, f)}
        turns = [s for s in records if s.source == "turn"]
        trajs = [s for s in records if s.source == "trajectory"]
        if turns and trajs:
            raise ValueError(f"{run_dir}: trace mixes OPD turns and GRPO trajectories")
        objective = "opd" if turns else "grpo"
        updates = []
        for u in sorted({s.update for s in records}):
            R = rollout.get(u)
            if not R or R <= 0:
                raise ValueError(f"{run_dir}: update {u} has no positive rollout_time_s in metrics.jsonl")
            rec: dict = {"groups": {}, "trajs": {}}
            for e in (s for s in records if s.update == u):
                j = e.turn or 0  # a GRPO trajectory: one turn
                n = e.span_tokens + (e.context if j == 0 else 0)
                # why: a source without scored tokens ran no learner work, so its trace has
                # no span; two unscored tokens replay it (validation and bookkeeping only)
                n = max(n, e.scored_tokens + 1, 2)
                item = dict(u=min(1.0, max(0.0, e.ready / R)), n=n, scored=e.scored_tokens)
                t = rec["trajs"].setdefault(e.traj_id, dict(group=e.group_id, turns={}, prompt=None))
                t["turns"][j] = item
                if j == 0 and e.context:  # the shared prompt ends before it
                    t["prompt"] = e.context + 1
                rec["groups"].setdefault(e.group_id, [])
                if e.traj_id not in rec["groups"][e.group_id]:
                    rec["groups"][e.group_id].append(e.traj_id)
            if len(rec["groups"]) < 2:
                raise ValueError(f"{run_dir}: update {u} has {len(rec['groups'])} group(s); "
                                 "two learner ranks need at least 2")
            updates.append(rec)
        return cls(objective, updates, vocab=vocab, seed=seed, token_scale=token_scale)

    def longest(self) -> int:
        """Tokens of the longest trajectory played (after token_scale; OPD: all its turns)."""
        return max(sum(self._scale(x["n"]) + 1 for x in t["turns"].values())
                   for rec in self.recorded for t in rec["trajs"].values())

    def _scale(self, n: int) -> int:
        return max(1, round(n * self.token_scale)) if n > 0 else 0

    def update(self, version: int, R: float, draw: int | None = None) -> tuple[BatchPlan, dict, list]:
        d = version if draw is None else draw
        rec = self.recorded[d % len(self.recorded)]
        rng = random.Random(self.seed * 1000 + d)
        plan, n_turns, items = BatchPlan(), {}, []
        ids = {}  # recorded id -> this update's id (policy version in the name, as the learner logs it)
        for g, (gid, members) in enumerate(rec["groups"].items()):
            new_gid = f"v{version}-g{g}"
            for i, tid in enumerate(members):
                ids[tid] = (new_gid, f"{new_gid}-t{i}")
            plan.add_group(new_gid, [ids[t][1] for t in members])
        shared: dict[str, list[int]] = {}  # a group's prompt tokens, the same for its members

        def head(gid: str, n: int) -> list[int]:
            p = shared.setdefault(gid, [])
            p += [rng.randrange(self.vocab) for _ in range(n - len(p))]
            return p[:n]

        for tid, t in rec["trajs"].items():
            gid, new_tid = ids[tid]
            prompt = self._scale(t["prompt"]) if t["prompt"] else None
            if self.objective == "grpo":
                x = t["turns"][0]
                scored = self._scale(x["scored"])
                n = max(self._scale(x["n"]), scored + max(prompt or 0, 1))
                tokens = tuple(head(gid, prompt or 0) + [rng.randrange(self.vocab)
                                                         for _ in range(n - (prompt or 0))])
                src = TrajectorySource(new_tid, gid, tokens, tuple([0] * (n - scored) + [1] * scored),
                                       rng.random(), version, prompt_len=prompt)
                items.append((x["u"] * R, src))
                continue
            n_turns[new_tid] = len(t["turns"])
            start = 0
            for j in range(len(t["turns"])):
                if j not in t["turns"]:
                    raise ValueError(f"recorded trajectory {tid}: turn {j} missing")
                x = t["turns"][j]
                scored = min(self._scale(x["scored"]), self._scale(x["n"]))
                lead = max(self._scale(x["n"]) - scored, prompt + 1 if j == 0 and prompt else 0)
                mask = [0] * lead + [1] * scored
                teacher = tuple(None if m == 0 else -rng.uniform(0.1, 5.0) for m in mask)
                q = prompt if j == 0 and prompt else 0
                tokens = tuple(head(gid, q) + [rng.randrange(self.vocab) for _ in mask[q:]])
                items.append((x["u"] * R, TurnSource(new_tid, gid, j, len(t["turns"]), start, tokens,
                                                     tuple(mask), teacher, version, prompt_len=prompt)))
                start += len(mask)
        items.sort(key=lambda x: x[0])
        return plan, n_turns, items


SCHEDULES = SYNC_SCHEDULES + ASYNC_SCHEDULES
PACK_DEFAULT = LearnerConfig.max_tokens_per_pass  # the learner's default token budget per pass
SEGMENT = 4  # updates an asynchronous schedule plays per round (a pipeline needs several)
STEADY_FROM = 2  # of those, the first ones fill the pipeline and are not measured




@dataclass(frozen=True)
class Step:
    """One update the simulator plays: which batch (draw) and how."""

    draw: int
    schedule: str
    calibration: bool = False  # every source ready at once (R = 0), to measure L(draw)
    warmup: bool = False  # played, not measured
    seg: int = 0  # asynchronous schedules: the update's place in its round's segment
    steady: bool = True  # measured (asynchronous: past the segment's pipeline fill)


def plan_steps(rounds: int, warmup: int = 1, schedules: tuple[str, ...] = SCHEDULES,
               segment: int = SEGMENT, steady_from: int = STEADY_FROM) -> list[Step]:
    """`warmup` rounds (draws -1, -2, …; not measured), then `rounds` rounds (draws 0, 1, …).
    A round is a calibration update of its draw (every source ready at once), then every
    schedule on that draw in an order rotated per round. A synchronous schedule plays one
    update; an asynchronous one a segment of `segment` consecutive updates of the same
    draw, of which those from `steady_from` on are its steady state (the first ones fill
    the pipeline). Calibration sits next to the updates it sets R for: the machine drifts
    over a run. A warm-up round runs every schedule once, so each one's first update in the
    process (cold code paths, the first G1'/G2 pairs allocated) is not measured."""
    if "sync" not in schedules:
        raise ValueError("the schedules compared must include sync (speedups are over it)")
    if not 0 <= steady_from < segment:
        raise ValueError(f"steady_from must be in [0, segment), got {steady_from}/{segment}")

    def play(draw: int, schedule: str, warm: bool) -> list[Step]:
        if schedule not in ASYNC_SCHEDULES:
            return [Step(draw=draw, schedule=schedule, warmup=warm)]
        return [Step(draw=draw, schedule=schedule, warmup=warm, seg=i, steady=i >= steady_from)
                for i in range(segment)]

    steps = []
    n = len(schedules)
    for i in range(warmup):
        steps += [Step(draw=-1 - i, schedule="sync", calibration=True)]
        for s in schedules:
            steps += play(-1 - i, s, True)
    for d in range(rounds):
        order = schedules[d % n:] + schedules[:d % n]
        steps += [Step(draw=d, schedule="sync", calibration=True)]
        for s in order:
            steps += play(d, s, False)
    return steps


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
        _ack(links[0], 0)
        v = 0
        while v < len(steps):
            step = steps[v]
            if not step.calibration:
                if step.draw not in L:
                    v_cal = v_of_calibration[step.draw]
                    L[step.draw] = _busiest_lane(_wait_for_trace(run_dir, v_cal), v_cal)
                R = ratio * L[step.draw]
            else:
                R = 0.0
                v_of_calibration[step.draw] = v
            if step.schedule in ASYNC_SCHEDULES:
                seg = _segment(steps, v)
                play = _play_one_step_off if step.schedule == "one_step_off" else \
                    partial(_play_fully_async, max_staleness=max_staleness)
                played += play(links, work, v, seg, R, routing)
                v += len(seg)
                gc.collect()  # the learners are in the segment's last optimizer step
                continue
            cpu0 = time.process_time()
            lag, sent = _play(links, work, v, step, R, routing)
            played.append(dict(R_s=R, sim_cpu_s=time.process_time() - cpu0, release_lag_s=lag,
                               sent_lag=sent, dropped_stale_groups=0))
            gc.collect()  # the learners are in their optimizer step
            _ack(links[0], v + 1)
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


def _segment(steps: list[Step], v: int) -> list[Step]:
    """The asynchronous segment starting at steps[v]."""
    seg = [steps[v]]
    while v + len(seg) < len(steps) and steps[v + len(seg)].seg == len(seg) \
            and steps[v + len(seg)].schedule == steps[v].schedule:
        seg.append(steps[v + len(seg)])
    return seg


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


def _play(links, work: Workload | RecordedWorkload, v: int, step: Step, R: float,
          routing: str = "balanced", sampled: int | None = None) -> tuple[list[float], list]:
    """One batch: register, release sources at their completion times, close at R.

    `sampled`: the policy version the sources carry (default v: on-policy).
    Returns each release's lag (its send's completion after its model time) and each
    source's (policy lag, scored tokens) as sent."""
    plan, n_turns, items = work.update(v, R, draw=step.draw)
    if sampled is not None:
        items = [(ready, replace(src, policy_version=sampled)) for ready, src in items]
    lag = _send_batch(links, work.objective, v, plan, n_turns, items, step.schedule, R, routing)
    return lag, _sent_lag(v, items)


def _sent_lag(v: int, items: list) -> list[tuple[int, int]]:
    return [(v - src.policy_version, src.n_scored) for _, src in items]


def _send_batch(links, objective: str, v: int, plan: BatchPlan, n_turns: dict, items: list,
                schedule: str, R: float, routing: str, rollout_s: float | None = None,
                metrics: dict | None = None) -> list[float]:
    """Register batch v, send its sources at their ready times (seconds after the
    registration) and close it at R (rollout_time_s: `rollout_s`, default the time taken).

    Routing as the real rollout does it (tsync_mcore.channel.routing): "balanced" sends each GRPO
    trajectory to the rank with the least tokens assigned so far and announces a split
    group's rewards to the ranks holding its members after its last one; "static" (and OPD)
    sends by group owner. Returns each release's lag: its send's completion after its
    model time."""
    grpo = objective == "grpo"
    routing = routing if grpo else "static"
    owner = assign_groups(plan, {}, 2)
    router = BalancedRouter(plan.groups, 2)
    msgs = []  # (ready, [(rank, message)])
    for ready, src in items:
        if not grpo:
            msgs.append((ready, [(owner[src.group_id], TurnMsg(src))]))
            continue
        if routing == "static":
            msgs.append((ready, [(owner[src.group_id], TrajectoryMsg(src))]))
            continue
        to = router.route(src.traj_id, src.group_id, src.reward, len(src.tokens))
        out = [(to.rank, TrajectoryMsg(src))]
        if to.rewards is not None:
            announce = GroupRewards(version=v, group_id=src.group_id, rewards=to.rewards)
            out += [(r, announce) for r in to.announce_to]
        msgs.append((ready, out))
    # Encoded now, while the learners wait for the registration: at release time a send is
    # the gloo op alone, so the simulated rollout takes less of the learners' cores.
    msgs = [(ready, [(rank, links[rank].prepare(msg)) for rank, msg in out])
            for ready, out in msgs]
    for link in links:
        link.send(RegisterBatch(version=v, objective=objective, groups=plan.groups,
                                n_turns=n_turns, data_pos=v + 1, schedule=schedule,
                                routing=routing))
    t0 = time.perf_counter()
    lag = []
    for ready, out in msgs:
        delay = t0 + ready - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for rank, msg in out:
            links[rank].send(msg)
        lag.append(time.perf_counter() - t0 - ready)
    if rollout_s is None:
        rollout_s = max(R, time.perf_counter() - t0)
    time.sleep(max(0.0, t0 + R - time.perf_counter()))
    for link in links:
        link.send(CloseBatch(version=v, rollout_time_s=rollout_s, n_sources=len(items),
                             metrics=metrics or {}))
    return lag


def _reload(link, loaded: int, need: int) -> int:
    """Acknowledge every publication that has arrived (the simulated rollout reloads in no
    time), waiting while the loaded version is below `need`; return the loaded version."""
    while True:
        msg = link.poll() if loaded >= need else link.recv(timeout_s=300)
        if msg is None:
            return loaded
        assert isinstance(msg, Publish) and msg.version == loaded + 1, (msg, loaded)
        link.send(Ack(version=msg.version, ok=True))
        loaded = msg.version


def _play_one_step_off(links, work, v0: int, seg: list[Step], R: float,
                       routing: str) -> list[dict]:
    """A one_step_off segment of updates v0 … v0+n−1 (docs/design/async.md): batch b is sampled
    with θ_{max(b−1, v0)}; its rollout starts when batch b−1 closes, waiting only until
    that version is published. The learner gets batch b's registration and sources while
    it still trains batch b−1. Afterwards every publication is acknowledged, so the next
    (synchronous) batch starts from the learner's latest θ."""
    loaded, out = v0, []
    for i, step in enumerate(seg):
        b = v0 + i
        need = one_step_off_sampler(b, v0)
        loaded = _reload(links[0], loaded, need)
        cpu0 = time.process_time()
        lag, sent = _play(links, work, b, step, R, routing, sampled=need)
        out.append(dict(R_s=R, sim_cpu_s=time.process_time() - cpu0, release_lag_s=lag,
                        sent_lag=sent, dropped_stale_groups=0))
    _reload(links[0], loaded, v0 + len(seg))
    return out


def _play_fully_async(links, work, v0: int, seg: list[Step], R: float, routing: str,
                      max_staleness: int) -> list[dict]:
    """A fully_async segment of updates v0 … v0+n−1 (docs/design/async.md): the draw's groups are
    generated as a continuous stream (group i of the stream is the draw's group i mod G,
    taking as long as its slowest member, u·R), a batch worth in flight, AReaL's staleness
    bound on starts (async_rollout.FullyAsyncStream); publications are loaded (and
    acknowledged) as they arrive. Each batch is the next G completed groups, registered,
    sent at once and closed; rollout_time_s is the time since the previous registration."""
    plan, n_turns, items = work.update(v0, R, draw=seg[0].draw)
    gids = list(plan.groups)
    members: dict[str, list] = {g: [] for g in gids}
    for ready, src in items:
        members[src.group_id].append((ready, src))
    G = len(gids)
    dur = [max(r for r, _ in members[g]) for g in gids]
    stream = FullyAsyncStream(G, max_staleness, v0, duration=lambda i: dur[i % G])
    link, out = links[0], []
    t0 = last = time.perf_counter()
    cpu0 = time.process_time()
    while len(out) < len(seg):
        now = time.perf_counter() - t0
        stream.complete_until(now)
        dropped = stream.dropped_stale
        batch = stream.take_batch()
        if batch is not None:
            k = v0 + len(out)
            bplan, bturns, bitems = _stream_batch(k, batch, gids, members, n_turns)
            t_reg = time.perf_counter()
            metrics = {"async/dropped_stale_groups": float(stream.dropped_stale - dropped)}
            lag = _send_batch(links, work.objective, k, bplan, bturns, bitems,
                              "fully_async", 0.0, routing, rollout_s=t_reg - last,
                              metrics=metrics)
            out.append(dict(R_s=t_reg - last, sim_cpu_s=0.0, release_lag_s=lag,
                            sent_lag=_sent_lag(k, bitems),
                            dropped_stale_groups=stream.dropped_stale - dropped,
                            # G slots, each a group at a time: a batch per mean duration
                            R_stream_s=mean(dur)))
            last = t_reg
            continue
        stream.start_groups(now)
        nxt = stream.next_completion()
        try:
            msg = link.recv(timeout_s=300 if nxt is None else max(0.0, nxt - now))
        except ChannelTimeout:
            continue  # a group completed
        assert isinstance(msg, Publish) and msg.version == stream.loaded + 1, (msg, stream.loaded)
        link.send(Ack(version=msg.version, ok=True))
        stream.load(msg.version)
    cpu = (time.process_time() - cpu0) / len(out)
    for o in out:
        o["sim_cpu_s"] = cpu
    _reload(link, stream.loaded, v0 + len(seg))
    return out


def _stream_batch(k: int, batch: list, gids: list[str], members: dict, n_turns: dict):
    """Batch k from the stream's groups: each one the draw's group (index mod G) under an id
    of this batch and stream place, its sources carrying the version that sampled them,
    ready at once (the group completed before the registration)."""
    plan, turns, items = BatchPlan(), {}, []
    for sg in batch:
        old = gids[sg.index % len(gids)]
        # "v<k>s<i>-g<j>": the part after the first "-" names the draw's group, as in sync
        new = f"v{k}s{sg.index}-{old.split('-', 1)[1]}"
        trajs = []
        for _, src in members[old]:
            tid = new + src.traj_id[len(old):]
            if tid not in trajs:
                trajs.append(tid)
            if src.traj_id in n_turns:
                turns[tid] = n_turns[src.traj_id]
            items.append((0.0, replace(src, traj_id=tid, group_id=new,
                                       policy_version=sg.version)))
        plan.add_group(new, trajs)
    return plan, turns, items


def _ack(link, version: int) -> None:
    msg = link.recv(timeout_s=300)
    assert isinstance(msg, Publish) and msg.version == version, msg
    link.send(Ack(version=version, ok=True))


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


def _busiest_lane(records: list[Record], update: int) -> float:
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


def _dispatch(records: list[Record], updates: set[int], streaming: bool) -> dict:
    if not streaming:
        return dict(dispatch_overhead=None, dispatch_idle=None, dispatch_idle_n=None)
    d = dispatch_overhead(records, updates)
    return dict(dispatch_overhead=d["all"], dispatch_idle=d["idle"], dispatch_idle_n=d["n_idle"])


def _packed_share(records: list[Record], updates: set[int]) -> float:
    """Share of the served sources that ran in a packed pass with others."""
    srcs = [r for r in trace.sources(records) if r.served and r.update in updates]
    return sum(r.pass_id is not None for r in srcs) / len(srcs) if srcs else 0.0


def _serve_cpu(records: list[Record], updates: set[int]) -> float:
    """Serving-thread CPU seconds per update, summed over ranks."""
    return sum(r.cpu for r in trace.work(records) if r.update in updates) / len(updates)


def _wall_over_cpu(records: list[Record], updates: set[int],
                   arriving: dict[int, float] | None = None) -> float | None:
    """Serving wall time over serving CPU time. `arriving` (update → R): only services that
    started while sources were still arriving (before R), when the simulator and the
    channel threads share the learners' cores; None where there were none (sync)."""
    es = [e for e in trace.work(records) if e.update in updates
          and (arriving is None or e.start < arriving[e.update])]
    if not es:
        return None
    return sum(e.end - e.start for e in es) / sum(e.cpu for e in es)


def _paired_service(by_update: dict[int, list[Record]], mine: list[dict],
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


def _group_ready_step(records: list[Record], R: float, P: float) -> float:
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
    L_sync = mean(_busiest_lane(by_update[r["policy_version"]], r["policy_version"])
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
            t_pred = mean(_group_ready_step(by_update[u], pred[u]["R"], pred[u]["P"]) for u in ups)
        else:
            t_pred = mean(_async_predicted(schedule, played, by_update, pred, P_sync))
        # per round (draw): the schedule's mean step (an asynchronous one plays several)
        per_draw = {}
        for r in mine:
            per_draw.setdefault(r["draw"], []).append(r["step_wall_time_s"])
        out.append(dict(
            objective=objective, schedule=schedule, ratio=ratio, batch=batch, rounds=rounds,
            routing=routing if objective == "grpo" else "static",
            max_tokens_per_pass=max_tokens_per_pass,  # 0: one source per pass
            minibatches=minibatches,  # PPO mini-batch steps per update
            packed_share=_packed_share(entries, set(ups)),
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
            **_policy_lag(mine),
            dropped_stale_groups=sum(r["dropped_stale_groups"] for r in mine),
            # only a streaming lane goes idle between arrivals, where the cost shows alone
            **_dispatch(entries, set(ups), schedule == "thundersync"),
            # serving wall time over the serving thread's CPU time: > 1 where the core or
            # the GIL was elsewhere (channel, simulator); CPU time itself shows cache effects
            wall_over_cpu=_wall_over_cpu(entries, set(ups)),
            wall_over_cpu_arriving=_wall_over_cpu(
                entries, set(ups), {r["policy_version"]: r["rollout_time_s"] for r in mine}),
            **_paired_service(by_update, mine, sync_rows),
            serve_cpu_s=_serve_cpu(entries, set(ups)),
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


def _async_predicted(schedule: str, played: list[dict], by_update: dict, pred: dict,
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


def _policy_lag(rows: list[dict]) -> dict:
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
