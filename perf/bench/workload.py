"""What the simulated rollout plays: the paper's completion-time model (`Workload`) or a real
run's recorded release trace (`RecordedWorkload`), as (plan, turns, [(ready time, source)])
per update."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass

from tsync_mcore.channel.sources import BatchPlan, TrajectorySource, TurnSource
from tsync_mcore.observability import trace

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
        out, start = [], 0
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


def timed_update(learner, work: Workload, draw: int) -> tuple[float, object]:
    """One update of `learner` on `work`'s batch `draw`, every source submitted at once (no
    release times): its wall seconds and the update's summary."""
    plan, n_turns, items = work.update(learner.version, R=0.0, draw=draw)
    plan.n_turns.update(n_turns)
    t0 = time.perf_counter()
    learner.begin(plan)
    for _, src in items:
        learner.submit(src)
    summary = learner.close().summary
    return time.perf_counter() - t0, summary
