"""One batch of the rollout: its plan, environments, agents' trajectories and turns, the
checks a source passes before it is sent, and sending it (RegisterBatch, routing, group
rewards, dropped groups). `BatchWork` is a part of RolloutDriver (tsync_mcore.rollout.driver);
the schedules (tsync_mcore.rollout.schedules) run it batch after batch."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tsync_mcore.channel import (DropGroup, GroupRewards, Publish, RegisterBatch, Rejected,
                                 Shutdown, TrajectoryMsg, TurnMsg)
from tsync_mcore.channel.routing import BalancedRouter
from tsync_mcore.channel.sources import (BatchPlan, SourceError, TrajectorySource, TurnSource,
                                         assign_groups, validate_source, validate_turn)
from tsync_mcore.data import DataError
from tsync_mcore.publication.receive import FINISHED, RolloutStopped
from tsync_mcore.rewards import RewardFailed
from tsync_mcore.rollout.envs import SkyRLGymAdapter, ToyToolConfig, ToyToolEnv
from tsync_mcore.rollout.openai.pool import AgentPoolDead
from tsync_mcore.rollout.oversample import Oversampling
from tsync_mcore.rollout.pacing import span_off_policy
from tsync_mcore.rollout.replicas import ReplicaError

# Failures that stop the rollout with their own one-line message (told to the learners)
STOPS = (RewardFailed, DataError, ReplicaError, AgentPoolDead)


class _LearnerFinished(Exception):
    """The learner said it finished (run.updates or run.budget_s): stop wherever we are."""


@dataclass
class _Batch:
    version: int
    groups: dict[str, list[str]]
    env_seeds: list[int]
    seeds: list[int]
    traj_ids: list[str]
    group_of: list[str]
    rows: list[int] | None = None  # dataset envs: each trajectory's row (its group's)


class BatchWork:
    """RolloutDriver's one-batch part; it uses the driver's state (cfg, rc, links, engine,
    feed, tok, dropped, loaded, ...)."""

    def _plan(self, version: int, data_pos: int) -> _Batch:
        groups, env_seeds, seeds, traj_ids, group_of = {}, [], [], [], []
        rows = [] if self.feed is not None else None
        # dynamic sampling: the reserve groups after the batch's own (rollout/oversample.py)
        for g in range(self.rc.groups_per_batch + self.rc.max_oversample):
            gid = f"v{version}-g{g}"
            members = [f"{gid}-t{i}" for i in range(self.rc.group_size)]
            groups[gid] = members
            for i, tid in enumerate(members):
                env_seeds.append(data_pos + g)  # members share the task (prompt)
                seeds.append(hash((self.cfg.seed, version, g, i)) & 0x7FFFFFFF)
                traj_ids.append(tid)
                group_of.append(gid)
                if rows is not None:  # data position data_pos + g: the group's row
                    rows.append(self.feed.train_row(data_pos + g))
        return _Batch(version, groups, env_seeds, seeds, traj_ids, group_of, rows)

    def _n_turns(self, batch: _Batch) -> dict[str, int]:
        # OPD registers turn counts up front; the toy task always runs max_turns turns.
        return {t: self.rc.max_turns for t in batch.traj_ids} if self.turns else {}

    def _owners(self, batch: _Batch) -> dict[str, list[int]]:
        """Group → the learner ranks that serve it (all TP ranks of its DP owner)."""
        owner = assign_groups(BatchPlan(groups=batch.groups), {}, self.rc.n_learners // self.tp)
        return {g: self._ranks_of(d) for g, d in owner.items()}

    def _ranks_of(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.tp + t for t in range(self.tp)]

    def _envs(self, batch: _Batch, salt: int | None = None) -> list:
        """The batch's environments; `salt` (fully_async: the group's data position) varies
        the toy tool's latencies from group to group."""
        n = len(batch.traj_ids)
        if self.feed is not None:
            return self.feed.train_envs(batch.rows, batch.traj_ids)
        if self.rc.env == "toy":
            conf = ToyToolConfig(max_turns=self.rc.max_turns,
                                 latency_median_s=self.rc.tool_latency_s,
                                 tool_timeout_s=self.rc.tool_timeout_s)
            rng = (lambda i: random.Random(i)) if salt is None else \
                (lambda i: random.Random(salt * 1_000_003 + i))
            return [ToyToolEnv(self.tok, conf, latency_rng=rng(i)) for i in range(n)]
        if self.rc.env == "terminal":
            from tsync_mcore.rollout.terminal_env import terminal_envs
            return terminal_envs(self.tok, n, max_turns=self.rc.max_turns,
                                 tools_cfg=self.cfg.tools)
        name = self.rc.env.split(":", 1)[1]
        prompt = [{"role": "user", "content": "Solve the task step by step."}]
        return [SkyRLGymAdapter.from_registry(name, self.tok, prompt) for _ in range(n)]

    def _drop(self, version: int, gid: str, reason: str, quiet: bool = False) -> None:
        """Group `gid` leaves update `version`: every learner rank is told, once."""
        if gid in self.dropped:
            return
        self.dropped[gid] = reason
        if not quiet:
            print(f"[rollout] dropped group {gid} of update {version}: {reason}", flush=True)
        for link in self.links:
            link.send(DropGroup(version=version, group_id=gid, reason=reason[:2000]))

    def _take_rejections(self, version: int) -> None:
        """Learner ranks say which sources they refused (a check the rollout did not make):
        the group is dropped everywhere. Never waits."""
        for link in self.links:
            while (msg := link.poll()) is not None:
                self._on_learner_message(msg, version)

    def _on_learner_message(self, msg, version: int) -> None:
        if isinstance(msg, Rejected):
            if msg.version == version:
                self._drop(version, msg.group_id, f"a learner rejected {msg.source}: {msg.reason}")
            else:  # a closed batch's: the learners agree on it at its close
                print(f"[rollout] learner rejected {msg.source} of update {msg.version}: "
                      f"{msg.reason}", flush=True)
            return
        if isinstance(msg, Shutdown):
            if msg.reason.startswith(FINISHED) or self._learner_finished():
                raise _LearnerFinished()
            raise RolloutStopped(f"learner shut down: {msg.reason}")
        if isinstance(msg, Publish) and self.schedule in ("one_step_off", "fully_async"):
            self.notices.append(msg)  # loaded between batches (one_step_off) or at once
            return
        raise RolloutStopped(f"unexpected {type(msg).__name__} from a learner mid-batch")

    def _checked(self, version: int, src) -> bool:
        """True if the source may be sent; otherwise its group is dropped."""
        if src.group_id in self.dropped:
            return False
        try:
            check = validate_turn if isinstance(src, TurnSource) else validate_source
            check(src, self.vocab_size, self.max_tokens)
        except SourceError as e:
            self._drop(version, src.group_id, str(e))
            return False
        return True

    def _register(self, version: int, groups: dict[str, list[str]], data_pos: int,
                  n_turns: dict[str, int]) -> None:
        """RegisterBatch of update `version` → every learner rank: its groups, turn counts
        (OPD), the data position after it and the routing."""
        msg = RegisterBatch(version=version, objective=self.cfg.learner.objective,
                            groups=groups, n_turns=n_turns, data_pos=data_pos,
                            routing=self.cfg.routing)
        for link in self.links:
            link.send(msg)

    def _send_trajectory(self, version: int, segs: list[TrajectorySource],
                         owners: dict[str, list[int]], router: BalancedRouter) -> None:
        """A finished, checked trajectory of update `version` (its segments, one message
        each, back to back) to the learner ranks: its group's owners (rollout.routing:
        static), or the one rank the balanced router picks for the whole trajectory,
        followed, once its group's last member is in, by the group's rewards to every rank
        holding a member."""
        src = segs[0]
        if self.cfg.routing == "static":
            for seg in segs:
                for r in owners[src.group_id]:
                    self.links[r].send(TrajectoryMsg(seg))
            return
        to = router.route(src.traj_id, src.group_id, src.reward,
                          sum(len(s.tokens) for s in segs))
        for seg in segs:
            for r in self._ranks_of(to.rank):
                self.links[r].send(TrajectoryMsg(seg))
        if to.rewards is not None:  # after its last member's message
            announce = GroupRewards(version=version, group_id=src.group_id, rewards=to.rewards)
            for d in to.announce_to:
                for r in self._ranks_of(d):
                    self.links[r].send(announce)

    async def _rollout(self, batch: _Batch) -> tuple[int, float | None]:
        owners = self._owners(batch)
        router = BalancedRouter(batch.groups, self.rc.n_learners // self.tp)
        order = 0
        self.dropped = {}

        def send(gid: str, msg) -> None:
            for r in owners[gid]:
                self.links[r].send(msg)

        def on_turn(i: int):
            tid, gid = batch.traj_ids[i], batch.group_of[i]

            async def release(turn: int, tokens: list[int], start: int, end: int,
                              mask: list[int], logprobs: list, versions: list) -> None:
                nonlocal order
                span = tokens[start:end]
                scored = [p for p in range(start, end) if mask[p]]
                teacher = await self.teacher.ascore(tokens[:end], scored)
                lp = [None] * (end - start)
                for p, v in zip(scored, teacher):
                    lp[p - start] = v
                behaviour, token_versions, sampled_by = span_off_policy(
                    logprobs, versions, mask, start, end, self.loaded)
                src = TurnSource(
                    traj_id=tid, group_id=gid, turn=turn, n_turns=self.rc.max_turns,
                    start=start, tokens=tuple(span),
                    scored_mask=tuple(mask[start:end]), teacher_logprobs=tuple(lp),
                    policy_version=sampled_by, ready_order=order,
                    prompt_len=None, behaviour_logprobs=behaviour,
                    token_versions=token_versions)
                self._take_rejections(batch.version)
                if self._checked(batch.version, src):
                    send(gid, TurnMsg(src))
                    order += 1
            return release

        rewards = []
        self.overlong = 0  # responses the overlong shaping penalised, this batch
        kwargs = dict(max_turns=self.rc.max_turns, max_tokens_per_turn=self.rc.max_tokens_per_turn,
                      max_total_tokens=self.rc.max_total_tokens, temperature=self.rc.temperature,
                      step_timeout_s=self._step_timeout_s(), **self._render_kwargs())
        envs = self._envs(batch)
        stats = self.feed.stats() if self.feed is not None else None
        # A group's members share their prompt: one replica serves the whole group.
        if self.turns:
            kwargs["on_turn"] = on_turn
        over = None
        if self.rc.max_oversample:  # dynamic sampling: reserves start as groups are filtered
            over = Oversampling(batch.groups, self.rc.groups_per_batch)
            kwargs["gate"] = lambda i: over.gate(batch.group_of[i])
        async for i, res in self._agents(batch, envs, kwargs):
            if res is None:  # a reserve group never started
                continue
            sent, n = self._finished(batch, envs, stats, i, res, order, owners, router,
                                     rewards)
            order += n
            if over is not None:
                over.member_done(batch.group_of[i], sent)
        if over is not None:
            for g in over.unused():
                self._drop(batch.version, g, "reserve group not needed (dynamic sampling)",
                           quiet=True)
        self._take_rejections(batch.version)
        ok = [r for r in rewards if isinstance(r, (int, float)) and math.isfinite(r)]
        reward_mean = sum(ok) / len(ok) if ok else None
        if stats is not None and stats.errors:  # reward.on_error: zero
            print(f"[rollout] {stats.errors} reward errors in update {batch.version}, scored 0; "
                  f"first: {stats.first_error}", flush=True)
        metrics = stats.metrics() if stats is not None else {}
        if over is not None:
            metrics.update(over.metrics())
        if self.cfg.reward.overlong_buffer:
            metrics["reward/overlong_share"] = self.overlong / max(len(rewards), 1)
        if self.oai is not None:
            metrics.update(self.oai.take_metrics())
            metrics.update(self.agent_counters.take())
        return order, reward_mean, metrics

    def _finished(self, batch: _Batch, envs, stats, i: int, res, order: int, owners,
                  router, rewards: list) -> tuple[float | None, int]:
        """Trajectory i ended: checked, shaped and sent (GRPO), or its group dropped.
        Returns the reward it was sent with (None: nothing was sent) and the sources sent
        (its segments)."""
        if not res.n_turns:  # an agent that failed before its first request
            self._drop(batch.version, batch.group_of[i],
                       f"trajectory {batch.traj_ids[i]}: its agent "
                       f"{res.extra.get('agent_status', 'ended')} before any request")
            return None, 0
        res.reward = self._shaped(res)
        rewards.append(res.reward)
        if stats is not None:
            stats.add(envs[i])
        gid = batch.group_of[i]
        self._take_rejections(batch.version)
        if self.turns:
            if res.n_turns != self.rc.max_turns:  # its turn count was registered up front
                self._drop(batch.version, gid,
                           f"OPD trajectory {batch.traj_ids[i]} ended after {res.n_turns} "
                           f"of {self.rc.max_turns} registered turns ({res.stop_reason}); "
                           f"raise rollout.max_total_tokens so every trajectory runs all "
                           f"its turns")
            return None, 0
        segs = self._trajectory(batch.traj_ids[i], gid, res, order)
        if not all(self._checked(batch.version, s) for s in segs):
            return None, 0
        self._send_trajectory(batch.version, segs, owners, router)
        return res.reward, len(segs)

    def _shaped(self, res) -> float:
        """The reward with DAPO's overlong shaping (reward.overlong_buffer): a response of L
        generated tokens past L_max − buffer loses (L − (L_max − buffer))/buffer·penalty."""
        rw = self.cfg.reward
        if not rw.overlong_buffer or not isinstance(res.reward, (int, float)):
            return res.reward
        budget = rw.overlong_max_len or self.rc.max_tokens_per_turn * self.rc.max_turns
        exceed = res.n_scored - (budget - rw.overlong_buffer)  # every segment's
        penalty = min(-exceed / rw.overlong_buffer * rw.overlong_penalty, 0.0)
        self.overlong = getattr(self, "overlong", 0) + (penalty < 0)
        return res.reward + penalty

    def _trajectory(self, traj_id: str, gid: str, res, order: int) -> list[TrajectorySource]:
        """A finished trajectory as sources, one per segment (one unless its history was
        rewritten): their sampling log-probs, and the versions that sampled them (the
        oldest as policy_version; per token when several). A later segment shares the
        group's prompt only if it starts with it."""
        segs = res.segments()
        n, total = len(segs), res.n_scored
        group_prompt = segs[0]["tokens"][:segs[0]["prompt_len"]]
        out = []
        for j, seg in enumerate(segs):
            toks, mask = seg["tokens"], seg["scored_mask"]
            behaviour, versions, sampled_by = span_off_policy(
                seg["logprobs"], seg["token_versions"], mask, 0, len(toks), self.loaded)
            shares = j == 0 or (toks[:len(group_prompt)] == group_prompt
                                and not any(mask[:len(group_prompt)]))
            out.append(TrajectorySource(
                traj_id=traj_id, group_id=gid, tokens=tuple(toks), scored_mask=tuple(mask),
                reward=res.reward, policy_version=sampled_by, ready_order=order + j,
                prompt_len=len(group_prompt) if shares else None,
                behaviour_logprobs=behaviour, token_versions=versions, segment=j,
                n_segments=n, trajectory_scored=total if n > 1 else None))
        return out

    def _render_kwargs(self) -> dict:
        """rollout.render: template: the built-in loop renders each turn with the chat
        template (loop.run_rendered)."""
        if self.rc.render != "template":
            return {}
        return dict(tokenizer=self.tok, template_kwargs=dict(self.rc.chat_template_kwargs))

    def _step_timeout_s(self) -> float:
        # The dataset env's step is the reward call, limited by reward.timeout_s itself.
        if self.rc.env == "dataset" or self.rc.env.startswith("reasoning_gym:"):
            return self.cfg.reward.timeout_s + 5.0
        if self.rc.env == "terminal":  # a turn's tool calls, then (last turn) the verifier
            t = self.cfg.tools
            return t.timeout_s * t.max_calls_per_turn + t.verify_timeout_s + 10.0
        return self.rc.tool_timeout_s * 2
