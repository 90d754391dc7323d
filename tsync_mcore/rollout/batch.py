"""One batch of the rollout, run: its agents' trajectories (or turns, OPD), each checked,
shaped and sent to the learner ranks the moment it is ready, and what the batch's
CloseBatch reports (`BatchOutcome`). The schedules (tsync_mcore.rollout.schedules) run a
`BatchRunner` batch after batch, or group after group (fully_async)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tsync_mcore.channel import TurnMsg
from tsync_mcore.channel.sources import SourceError, TurnSource, validate_source
from tsync_mcore.config import Config
from tsync_mcore.data import DataError
from tsync_mcore.rewards import RewardFailed
from tsync_mcore.rollout.agents import Agents
from tsync_mcore.rollout.engine import EngineThread
from tsync_mcore.rollout.feed import DataFeed
from tsync_mcore.rollout.learners import LearnerLinks
from tsync_mcore.rollout.loop import run_batch
from tsync_mcore.rollout.openai.pool import AgentPoolDead
from tsync_mcore.rollout.oversample import Oversampling
from tsync_mcore.rollout.pacing import Group, span_off_policy
from tsync_mcore.rollout.plan import Batch, batch_envs, loop_kwargs, plan_group
from tsync_mcore.rollout.replicas import ReplicaError
from tsync_mcore.rollout.served import ServedPolicy
from tsync_mcore.rollout.sources import shaped_reward, trajectory_sources
from tsync_mcore.rollout.types import TrajectoryResult

# Failures that stop the rollout with their own one-line message (told to the learners)
STOPS = (RewardFailed, DataError, ReplicaError, AgentPoolDead)


@dataclass
class BatchOutcome:
    """What a batch's CloseBatch reports: the sources sent, the mean of the finite rewards
    (None: none), and the batch's metrics."""
    n_sources: int
    reward_mean: float | None
    metrics: dict[str, Any] = field(default_factory=dict)


def mean_reward(rewards: list) -> float | None:
    """CloseBatch.reward_mean: the mean of the finite numeric rewards; None if none."""
    ok = [r for r in rewards if isinstance(r, (int, float)) and math.isfinite(r)]
    return sum(ok) / len(ok) if ok else None


@dataclass
class _Tally:
    """One batch's running counts, dropped with it."""
    order: int = 0  # sources sent so far: the next ready_order
    rewards: list = field(default_factory=list)
    overlong: int = 0  # responses the overlong shaping penalised


class BatchRunner:
    """Runs batches of `cfg` on `engine` through `agents`, sending to the learner ranks on
    `links`; `policy` says which version the engine serves, `teacher` scores OPD turns."""

    def __init__(self, cfg: Config, engine: Any, links: LearnerLinks, feed: DataFeed | None,
                 *, agents: Agents, policy: ServedPolicy, et: EngineThread, tok: Any,
                 teacher: Any = None):
        self.cfg, self.rc = cfg, cfg.rollout
        self.engine, self.links, self.feed = engine, links, feed
        self.agents, self.policy, self.et, self.tok = agents, policy, et, tok
        self.teacher = teacher  # OPD: the objective's sources are turns, not trajectories
        self.turns = teacher is not None

    def engine_metrics(self) -> dict:
        """The replicas' counters, and the judge's (reward/judge_*) since the last call."""
        out = self.engine.take_metrics()
        if self.feed is not None and self.feed.judge is not None:
            out.update(self.feed.judge.take_metrics())
        return out

    async def run(self, batch: Batch) -> BatchOutcome:
        """Launch every trajectory of the registered `batch` at once; each is sent the moment
        its reward is fixed (or each turn once the teacher scored it, OPD)."""
        links, version = self.links, batch.version
        owners = links.owners(batch.groups)
        router = links.router(batch.groups)
        tally = _Tally()
        kwargs = loop_kwargs(self.cfg, self.tok)
        envs = batch_envs(self.cfg, self.tok, self.feed, batch)
        stats = self.feed.stats() if self.feed is not None else None
        if self.turns:
            kwargs["on_turn"] = lambda i: self._turn_release(batch, i, owners, tally)
        over = None
        if self.rc.max_oversample:  # dynamic sampling: reserves start as groups are filtered
            over = Oversampling(batch.groups, self.rc.groups_per_batch)
            kwargs["gate"] = lambda i: over.gate(batch.group_of[i])
        # A group's members share their prompt: one replica serves the whole group.
        async for i, res in self.agents.run(batch, envs, kwargs):
            if res is None:  # a reserve group never started
                continue
            sent = self._finished(batch, envs, stats, i, res, owners, router, tally)
            if over is not None:
                over.member_done(batch.group_of[i], sent)
        if over is not None:
            for g in over.unused():
                links.drop(version, g, "reserve group not needed (dynamic sampling)",
                           quiet=True)
        links.take_messages(version)
        if stats is not None and stats.errors:  # reward.on_error: zero
            print(f"[rollout] {stats.errors} reward errors in update {version}, scored 0; "
                  f"first: {stats.first_error}", flush=True)
        metrics = stats.metrics() if stats is not None else {}
        if over is not None:
            metrics.update(over.metrics())
        if self.cfg.reward.overlong_buffer:
            metrics["reward/overlong_share"] = tally.overlong / max(len(tally.rewards), 1)
        metrics.update(self.agents.take_metrics())
        return BatchOutcome(tally.order, mean_reward(tally.rewards), metrics)

    def _turn_release(self, batch: Batch, i: int, owners: dict[str, list[int]],
                      tally: _Tally) -> Callable[..., Awaitable[None]]:
        """OPD: trajectory i's on_turn callback, which sends each turn once the teacher
        scored it."""
        tid, gid = batch.traj_ids[i], batch.group_of[i]

        async def release(turn: int, tokens: list[int], start: int, end: int,
                          mask: list[int], logprobs: list, versions: list) -> None:
            span = tokens[start:end]
            scored = [p for p in range(start, end) if mask[p]]
            teacher = await self.teacher.ascore(tokens[:end], scored)
            lp = [None] * (end - start)
            for p, v in zip(scored, teacher):
                lp[p - start] = v
            behaviour, token_versions, sampled_by = span_off_policy(
                logprobs, versions, mask, start, end, self.policy.loaded)
            src = TurnSource(
                traj_id=tid, group_id=gid, turn=turn, n_turns=self.rc.max_turns,
                start=start, tokens=tuple(span),
                scored_mask=tuple(mask[start:end]), teacher_logprobs=tuple(lp),
                policy_version=sampled_by, ready_order=tally.order,
                prompt_len=None, behaviour_logprobs=behaviour,
                token_versions=token_versions)
            self.links.take_messages(batch.version)
            if self.links.checked(batch.version, src):
                self.links.send(owners[gid], TurnMsg(src))
                tally.order += 1
        return release

    def _finished(self, batch: Batch, envs: list, stats: Any, i: int, res: TrajectoryResult,
                  owners: dict[str, list[int]], router: Any, tally: _Tally) -> float | None:
        """Trajectory i ended: checked, shaped and sent (GRPO), or its group dropped.
        Returns the reward it was sent with (None: nothing was sent); the sources sent
        (its segments) advance `tally.order`."""
        links, version, gid = self.links, batch.version, batch.group_of[i]
        if not res.n_turns:  # an agent that failed before its first request
            links.drop(version, gid, f"trajectory {batch.traj_ids[i]}: its agent "
                                     f"{res.extra.get('agent_status', 'ended')} before any "
                                     f"request")
            return None
        res.reward, penalised = shaped_reward(res, self.cfg.reward, self.rc)
        tally.overlong += penalised
        tally.rewards.append(res.reward)
        if stats is not None:
            stats.add(envs[i])
        links.take_messages(version)
        if self.turns:
            if res.n_turns != self.rc.max_turns:  # its turn count was registered up front
                links.drop(version, gid,
                           f"OPD trajectory {batch.traj_ids[i]} ended after {res.n_turns} "
                           f"of {self.rc.max_turns} registered turns ({res.stop_reason}); "
                           f"raise rollout.max_total_tokens so every trajectory runs all "
                           f"its turns")
            return None
        segs = trajectory_sources(batch.traj_ids[i], gid, res, tally.order, self.policy.loaded)
        if not all(links.checked(version, s) for s in segs):
            return None
        links.send_trajectory(version, segs, owners, router)
        tally.order += len(segs)
        return res.reward

    # --- fully_async: group by group ------------------------------------------------------

    async def run_group(self, pos: int) -> Group | None:
        """One GRPO group at data position `pos`, its members' sources built as they end;
        None if a member fails the source checks (said why)."""
        batch = plan_group(self.cfg, self.feed, pos)
        gid = batch.group_of[0]
        envs = batch_envs(self.cfg, self.tok, self.feed, batch, salt=pos)
        members, stats = [], self.feed.stats() if self.feed is not None else None
        async for i, res in run_batch(self.engine, envs, seeds=batch.seeds,
                                      env_seeds=batch.env_seeds, routes=batch.group_of,
                                      **loop_kwargs(self.cfg, self.tok)):
            if stats is not None:
                stats.add(envs[i])
            res.reward, _ = shaped_reward(res, self.cfg.reward, self.rc)
            segs = trajectory_sources(batch.traj_ids[i], gid, res, 0, self.policy.loaded)
            try:
                for src in segs:
                    validate_source(src, self.links.vocab_size, self.links.max_tokens)
            except SourceError as e:
                print(f"[rollout] dropped group {gid}: {e}", flush=True)
                return None
            members.extend(segs)
        return Group(gid, pos, members, min(x.policy_version for x in members))

    def send_groups(self, k: int, groups: list[Group], data_pos: int) -> BatchOutcome:
        """Register batch k with these completed groups and send their sources (not yet
        closed); its metrics: async/partial_sources."""
        links = self.links
        links.take_messages(k)
        plan = {g.group_id: list(dict.fromkeys(x.traj_id for x in g.members)) for g in groups}
        links.register(k, plan, data_pos, {})
        owners, router = links.owners(plan), links.router(plan)
        order, partial, rewards = 0, 0, []
        for g in groups:
            trajs: dict[str, list] = {}  # a trajectory's segments travel together
            for src in g.members:
                trajs.setdefault(src.traj_id, []).append(src)
            for segs in trajs.values():
                links.take_messages(k)
                if g.group_id in links.dropped:
                    break
                segs = [dataclasses.replace(s, ready_order=order + j) for j, s in enumerate(segs)]
                order += len(segs)
                partial += any(bool(s.token_versions) for s in segs)
                rewards.append(segs[0].reward)
                links.send_trajectory(k, segs, owners, router)
        links.take_messages(k)
        return BatchOutcome(order, mean_reward(rewards), {"async/partial_sources": partial})
