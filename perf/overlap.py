"""Trace-driven overlap benchmark: same update, shorter step — measured on this machine.

A rollout simulator plays the paper's completion-time model and delivers real sources
(real token sequences) through the real readiness channel to the real learner (Megatron
model, 2 gloo ranks, one thread each). Trajectory i completes at τ_i = U_i·R with
U_i ~ Uniform(0, 1); its length (and so its learner service) grows as U_i^γ; GRPO groups
have m members; OPD trajectories release `turns` turns spread over their lifetime. The
simulator sleeps: it does not compete for the learner's cores.

R is set from the learner time L of the same workload (a calibration run with every source
available at once): R = r·L. Each cell runs `updates` updates and discards the warm-up.
Speedup = mean step time of `sync` / mean step time of the schedule, same workload; the
predicted speedup replays the run's own trace through Eq. 14 (tsync_mcore.predict).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from statistics import mean, median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tsync_mcore import predict  # noqa: E402
from tsync_mcore.channel import (Ack, CloseBatch, Hello, Publish, RegisterBatch,  # noqa: E402
                                 TrajectoryMsg, TurnMsg, open_rollout_side)
from tsync_mcore.sources import BatchPlan, TrajectorySource, TurnSource, assign_groups  # noqa: E402

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

    def update(self, version: int, R: float) -> tuple[BatchPlan, dict, list]:
        """(plan, n_turns, [(ready_time, source)]) for one update."""
        rng = random.Random(self.seed * 1000 + version)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cell(hf_dir: str, run_dir: str, work: Workload, schedule: str, R: float,
             updates: int, k_open: int = 16) -> dict:
    """Launch 2 learner ranks, play `updates` batches, return the run's metrics rows.

    k_open defaults to every group of a rank: a tighter cap holds back sources of new
    groups until open ones close, which on small batches turns into learner tail."""
    port = free_port()
    os.makedirs(run_dir, exist_ok=True)
    sets = [f"model.hf_dir={hf_dir}", f"run.dir={run_dir}", f"run.updates={updates}",
            "run.save_every=0", f"run.publish_dir={run_dir}/publish", f"channel.port={port}",
            f"learner.schedule={schedule}", f"learner.objective={work.objective}",
            f"learner.k_open={k_open}", "channel.timeout_s=300"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one core per learner rank
    learner = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), os.path.join(ROOT, "launch/learner.py"),
         "--config", os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"), "--set", *sets],
        cwd=ROOT, env=env, stdout=open(os.path.join(run_dir, "learner.out"), "w"),
        stderr=open(os.path.join(run_dir, "learner.err"), "w"))
    links = open_rollout_side("127.0.0.1", port, 2, timeout_s=300)
    try:
        assert isinstance(links[0].recv(), Hello)
        _ack(links[0], 0)
        for v in range(updates):
            plan, n_turns, items = work.update(v, R)
            owner = assign_groups(plan, {}, 2)
            for link in links:
                link.send(RegisterBatch(version=v, objective=work.objective, groups=plan.groups,
                                        n_turns=n_turns, data_pos=v + 1))
            t0 = time.perf_counter()
            for ready, src in items:
                delay = t0 + ready - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                msg = TrajectoryMsg(src) if work.objective == "grpo" else TurnMsg(src)
                links[owner[src.group_id]].send(msg)
            rollout_s = max(R, time.perf_counter() - t0)
            time.sleep(max(0.0, t0 + R - time.perf_counter()))
            for link in links:
                link.send(CloseBatch(version=v, rollout_time_s=rollout_s, n_sources=len(items)))
            _ack(links[0], v + 1)
        learner.wait(timeout=300)
    finally:
        for link in links:
            link.close()
        if learner.poll() is None:
            learner.kill()
    if learner.returncode != 0:
        raise RuntimeError(f"learner failed ({learner.returncode}); see {run_dir}/learner.err")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _ack(link, version: int) -> None:
    msg = link.recv(timeout_s=300)
    assert isinstance(msg, Publish) and msg.version == version, msg
    link.send(Ack(version=version, ok=True))


def learner_time(run_dir: str, warmup: int) -> float:
    """L: the busiest rank's total service time per update, steady-state mean."""
    per_update: dict[int, dict[int, float]] = {}
    for r in (0, 1):
        path = os.path.join(run_dir, "traces", f"rank{r}.jsonl")
        for line in open(path):
            e = json.loads(line)
            if "start" in e:
                u = per_update.setdefault(e["update"], {})
                u[r] = u.get(r, 0.0) + e["end"] - e["start"]
    return mean(max(v.values()) for k, v in sorted(per_update.items()) if k >= warmup)


def dispatch_overhead(run_dir: str) -> float:
    """Per-source scheduling + bookkeeping cost as a fraction of learner service: for sources
    that found their rank idle, the gap between arrival and service start."""
    gaps, service = [], []
    for r in (0, 1):
        entries = [json.loads(line) for line in open(os.path.join(run_dir, "traces", f"rank{r}.jsonl"))]
        by_update: dict[int, list[dict]] = {}
        for e in entries:
            if "start" in e and e.get("kind") in (None, "turn"):
                by_update.setdefault(e["update"], []).append(e)
        for es in by_update.values():
            es.sort(key=lambda e: e["start"])
            prev_end = -1.0
            for e in es:
                if e["ready"] >= prev_end:  # lane idle when it arrived
                    gaps.append(e["start"] - e["ready"])
                service.append(e["end"] - e["start"])
                prev_end = e["end"]
    return median(gaps) / median(service) if gaps and service else float("nan")


def predicted_speedup(run_dir: str, warmup: int, schedule: str) -> float:
    res = predict.analyze_run(run_dir, warmup=warmup)
    if schedule == "sync":
        return 1.0
    if schedule == "thundersync":
        return res["T_sync_mean"] / res["T_thundersync_mean"]
    return _group_ready_prediction(run_dir, warmup, res)


def _group_ready_prediction(run_dir: str, warmup: int, res: dict) -> float:
    """Eq. 14 with each source released at its group's last arrival (group_ready)."""
    rollout = {json.loads(line)["policy_version"]: json.loads(line)["rollout_time_s"]
               for line in open(os.path.join(run_dir, "metrics.jsonl"))}
    entries = [json.loads(line) for r in (0, 1)
               for line in open(os.path.join(run_dir, "traces", f"rank{r}.jsonl"))]
    t_gr = []
    for upd in res["updates"][warmup:]:
        es = [e for e in entries if e["update"] == upd["update"] and "start" in e]
        # GRPO: a group's sources wait for its last member; OPD: a trajectory's turns wait
        # for its last turn. Replay/prefix work keeps its own release time.
        unit = lambda e: e["traj_id"] if e.get("kind") == "turn" else e.get("group_id")  # noqa: E731
        last: dict[str, float] = {}
        for e in es:
            if e.get("kind") in (None, "turn"):
                last[unit(e)] = max(last.get(unit(e), 0.0), e["ready"])
        lanes: dict[int, list] = {}
        for e in es:
            release = last[unit(e)] if e.get("kind") in (None, "turn") else e["ready"]
            lanes.setdefault(e["rank"], []).append((release, e["end"] - e["start"]))
        P = upd["publish_s"] + upd["step_s"]
        t_gr.append(max(predict.replay_lane(jobs, rollout[upd["update"]], P)
                        for jobs in lanes.values()))
    return res["T_sync_mean"] / mean(t_gr)


def cell(hf_dir: str, out_dir: str, objective: str, ratio: float, batch: int,
         updates: int, warmup: int = 1) -> list[dict]:
    """All three schedules at one (objective, ratio, batch)."""
    work = Workload(objective=objective, batch=batch)
    calib = run_cell(hf_dir, os.path.join(out_dir, f"{objective}-b{batch}-calib"), work, "sync",
                     R=0.0, updates=warmup + 2)
    L = learner_time(os.path.join(out_dir, f"{objective}-b{batch}-calib"), warmup)
    R = ratio * L
    rows = []
    for schedule in ("sync", "group_ready", "thundersync"):
        d = os.path.join(out_dir, f"{objective}-r{ratio}-b{batch}-{schedule}")
        metrics = run_cell(hf_dir, d, work, schedule, R, updates)
        steady = metrics[warmup:]
        rows.append(dict(
            objective=objective, schedule=schedule, ratio=ratio, batch=batch, R_s=R, L_s=L,
            step_time_s=mean(m["step_wall_time_s"] for m in steady),
            learner_tail_s=mean(m["learner_tail_s"] for m in steady),
            mfu_active=mean(m["mfu_active"] for m in steady),
            peak_mem_bytes=max(m["peak_mem_bytes"] for m in steady),
            speedup_predicted=predicted_speedup(d, warmup, schedule),
            # only a streaming lane goes idle between arrivals, where the cost shows alone
            dispatch_overhead=dispatch_overhead(d) if schedule == "thundersync" else None,
            run_dir=d))
    sync_t = rows[0]["step_time_s"]
    for r in rows:
        r["speedup_measured"] = sync_t / r["step_time_s"]
        r["measured_over_predicted"] = r["speedup_measured"] / r["speedup_predicted"]
    return rows
