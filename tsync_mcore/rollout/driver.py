"""The rollout process: vLLM engines + agent loop, streaming ready sources to the learners.

rollout.replicas engines (tsync_mcore.rollout.replicas) serve one agent loop: a group's
requests go to one replica, every replica loads every publication before the Ack.

    hello ← learner rank 0 (resume point)   reload θ_start, ack
    per update k:
      RegisterBatch → every learner rank (the groups of batch k and the routing)
      launch every trajectory at once; each one is sent to a learner rank the moment its
      reward is fixed (GRPO: balanced routing picks the least-loaded rank, and a split
      group's rewards go to the ranks holding its members once its last one is in) — or
      each turn to its group's owner the moment the teacher scored it (OPD). A source
      that fails validation here, or that a learner rank rejects (Rejected), drops its
      group: DropGroup → every rank, and nothing more of the group is sent
      CloseBatch → every rank; wait for Publish(θ_{k+1}) (a path under publish.dir, or the
      rollout stops), reload in place, reset the prefix
      cache, Ack. Only then does batch k+1 start.
A learner that dies or stops surfaces here as PeerGone/ChannelTimeout: the rollout stops
cleanly with that reason instead of hanging.

The asynchronous schedules (docs/async.md) keep the messages and change when they go:
  one_step_off: batch b is sampled with θ_{max(b−1, v0)}. Between batches every Publish
      that has arrived is reloaded and acknowledged; the loop blocks only while the loaded
      version is below b − 1.
  fully_async: groups are generated continuously (rollout.max_groups_in_flight at once,
      AReaL's staleness bound); a Publish is loaded as soon as it arrives, mid-request
      (abort and continue: every token keeps the version that sampled it). Batch k is
      registered once a batch worth of groups has completed, in completion order; a group
      older than learner.max_staleness at that point is dropped and counted, never sent.
Every source carries its sampling log-probs (behaviour_logprobs) on every schedule.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import time
from typing import Any
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from tsync_mcore.channel import (ChannelError, CloseBatch, DropGroup, GroupRewards, Hello,
                                 Link, Publish, RegisterBatch, Rejected, Shutdown,
                                 TrajectoryMsg, TurnMsg, channel_secret,
                                 open_rollout_side)
from tsync_mcore.publication import receive, send as publish
# RolloutStopped and the publication checks live with the rest of the receiving side
from tsync_mcore.publication.receive import (FINISHED, RolloutStopped,  # noqa: F401
                                             await_publish, check_publish)
from tsync_mcore.config import Config
from tsync_mcore.objectives import OBJECTIVES
from tsync_mcore.rollout.loop import run_batch
from tsync_mcore.rollout.engine import EngineThread, RolloutEngine, TeacherScorer
from tsync_mcore.rollout.envs import SkyRLGymAdapter, ToyToolConfig, ToyToolEnv
from tsync_mcore.rollout.feed import DataFeed
from tsync_mcore.rollout.openai.pool import AgentPoolDead
from tsync_mcore.rollout.pacing import BatchFormer, Group, may_start, span_off_policy
from tsync_mcore.rollout.replicas import (ReplicaError, ReplicaSet, cpu_memory_note,
                                          start_replicas)
from tsync_mcore.rewards import RewardFailed
from tsync_mcore.data import DataError
from tsync_mcore.channel.routing import BalancedRouter
from tsync_mcore.util.safe_files import check_hf_dir
from tsync_mcore.channel.sources import (BatchPlan, SourceError, TrajectorySource, TurnSource,
                                 assign_groups, validate_source, validate_turn)


VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # rollout.dtype → vLLM's name
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


class RolloutDriver:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rc = cfg.rollout
        # The objective's source kind decides what is sent: whole trajectories when their
        # reward is fixed, or each turn once the teacher has scored it.
        self.turns = OBJECTIVES[cfg.learner.objective].source == "turn"
        self.tp = cfg.model.tp
        # vLLM and transformers read these dirs later with tracebacks of their own; a broken
        # config.json or truncated shard is named here, in one line, before anything starts.
        check_hf_dir(cfg.model.hf_dir)
        if self.turns and self.rc.teacher_dir:
            check_hf_dir(self.rc.teacher_dir)
        # Datasets and the reward function are checked before the channel opens: a bad row
        # or spec stops here in one line, not after the learners joined.
        self.feed = DataFeed(cfg) if self.rc.env not in ("toy", "terminal") else None
        self.pending_metrics: dict = {}  # evaluation results for the next CloseBatch
        ch = cfg.channel
        self.links: list[Link] = open_rollout_side(ch.listen_addr or ch.addr, ch.port,
                                                   self.rc.n_learners,
                                                   timeout_s=ch.timeout_s,
                                                   realtime_io=ch.realtime_io,
                                                   secret=channel_secret(cfg),
                                                   join_timeout_s=ch.join_timeout_s)
        self.tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
        if self.feed is not None:
            self.feed.attach(self.tok)
        # Sources are checked here as the learner checks them, so a bad one (a broken reward
        # function, an engine emitting ids outside the vocabulary) drops its group before
        # any of it is sent, instead of reaching a learner rank.
        hf = AutoConfig.from_pretrained(cfg.model.hf_dir)
        self.vocab_size = hf.vocab_size
        positions = getattr(hf, "max_position_embeddings", None) or 4096  # as the learner's bridge
        self.max_tokens = min(positions, cfg.learner.max_tokens or positions)
        self.dropped: dict[str, str] = {}  # this batch's dropped groups: why
        self.schedule = cfg.learner.schedule
        self.notices: list[Publish] = []  # Publish messages taken mid-batch, not yet loaded
        self.loaded = 0  # the policy version the engine serves
        self.swaps = 0  # weight reloads since the last CloseBatch (async/weight_swaps)
        self.et = EngineThread()
        self.engine: ReplicaSet = self.et.run(self._make_engine())
        self.teacher = TeacherScorer(self.rc.teacher_dir) if self.turns else None
        self.oai = self.agent_counters = self.pool = None
        if self.rc.agent == "openai":
            self._start_openai()
        if self.turns and not self.rc.teacher_dir:
            raise RolloutStopped("OPD needs rollout.teacher_dir (the frozen teacher's HF "
                                 "directory)")

    async def _make_engine(self) -> ReplicaSet:
        """rollout.replicas engines (one is a set of one), started and warmed up."""
        gpu = torch.cuda.is_available()

        def make() -> RolloutEngine:
            return RolloutEngine(self.cfg.model.hf_dir, seed=self.cfg.seed,
                                 kv_cache_gib=self.rc.kv_cache_gib,
                                 max_model_len=max(self.rc.max_total_tokens, 64),
                                 dtype=VLLM_DTYPES[self.rc.dtype],  # resolved: auto → model.dtype
                                 tensor_parallel_size=self.rc.tp,
                                 lora_rank=self.cfg.model.lora.rank
                                 if self.cfg.publish.lora == "adapter" else 0,
                                 gpu_memory_utilization=self.rc.gpu_memory_utilization if gpu
                                 else None)

        note = None if gpu else cpu_memory_note(self.rc.replicas, self.rc.kv_cache_gib,
                                                  self.cfg.model.hf_dir)
        if note:  # a warning: vLLM's own start fails later if it truly does not fit
            print(f"[rollout] warning: {note}", flush=True)
        try:
            engine = start_replicas(self.rc.replicas, make, tp=self.rc.tp)
        except ReplicaError as e:
            raise RolloutStopped(str(e)) from e
        try:
            await engine.warmup()
        except BaseException:
            await engine.aclose()
            raise
        engine.take_metrics()  # warm-up requests are no update's
        return engine

    def _start_openai(self) -> None:
        """rollout.agent: openai: the OpenAI-compatible endpoint on the engine's loop
        (docs/agents.md), with a random key for this run."""
        import secrets

        from tsync_mcore.rollout.openai.processes import AgentCounters
        from tsync_mcore.rollout.openai.server import OpenAIServer

        self.oai = OpenAIServer(self.engine, self.tok, api_key=secrets.token_urlsafe(24),
                                model=os.path.basename(os.path.normpath(self.cfg.model.hf_dir)),
                                history=self.rc.openai_history, temperature=self.rc.temperature,
                                current_version=lambda: self.loaded)
        self.agent_counters = AgentCounters()
        host, _, port = self.rc.serve_openai.rpartition(":")
        try:
            host, port = self.et.run(self.oai.start(host.strip("[]"), int(port)))
        except OSError as e:
            raise RolloutStopped(f"rollout.serve_openai: cannot serve on "
                                 f"{self.rc.serve_openai}: {e}") from None
        print(f"[rollout] OpenAI-compatible endpoint at http://{host}:{port}/t/<trajectory>/v1",
              flush=True)

    def _agents(self, batch: _Batch, envs: list, kwargs: dict, prompts: Any = None):
        """The batch's trajectories: the built-in loop, or one agent process each talking to
        the endpoint (rollout.agent: openai). `prompts`: the PromptSet of `batch.rows`
        (default: data.train; evaluation passes data.eval)."""
        if self.oai is None:
            return run_batch(self.engine, envs, seeds=batch.seeds, env_seeds=batch.env_seeds,
                             routes=batch.group_of, **kwargs)
        from tsync_mcore.rollout.openai.processes import (DEFAULT_COMMAND, TERMINAL_COMMAND,
                                                       run_agents)
        from tsync_mcore.rollout.openai.pool import AgentPool

        rc = self.rc
        limits = dict(max_turns=rc.max_turns, max_tokens_per_turn=rc.max_tokens_per_turn,
                      max_total_tokens=rc.max_total_tokens)
        tools = None
        if self.feed is not None:  # rollout.env: dataset: the row's chat messages
            from tsync_mcore.data import row_messages
            rows = prompts or self.feed.train
            messages = [row_messages(rows.row(r), self.cfg.data.system_prompt)
                        for r in batch.rows]
        elif rc.env == "terminal":  # each episode's repo, its tools run there
            messages = [env.start(seed) for env, seed in zip(envs, batch.env_seeds)]
            tools = [env.box for env in envs]
        else:
            messages = [ToyToolEnv.task_messages(seed) for seed in batch.env_seeds]
        tasks = [{"messages": m, "model": self.oai.model,
                  "temperature": kwargs.get("temperature", rc.temperature), **limits}
                 for m in messages]

        async def task_reward(i: int, actions: list[list[int]]) -> float:
            """The task's reward from the recorded actions, when the agent posted none."""
            env = envs[i]
            if tools is not None:  # the hidden tests on what the agent left in the repo
                return await env.verify()
            env.reset(batch.env_seeds[i])
            if self.feed is not None:  # reward.function on the final answer's text
                await env.step(actions[-1])
            else:  # the toy env sees every completion, as in the built-in loop
                for a in actions:
                    env._account(a)
            return env.reward()

        command = rc.agent_command or (TERMINAL_COMMAND if rc.env == "terminal"
                                       else DEFAULT_COMMAND)
        if rc.agent_pool and self.pool is None:  # started with the first batch, kept
            self.pool = AgentPool(self.oai, command=command, size=rc.agent_pool,
                                  run_dir=self.cfg.run.dir, timeout_s=rc.agent_timeout_s,
                                  counters=self.agent_counters)
        return run_agents(self.oai, traj_ids=batch.traj_ids, group_of=batch.group_of,
                          tasks=tasks, seeds=batch.seeds, version=self.loaded, limits=limits,
                          command=command, pool=self.pool, timeout_s=rc.agent_timeout_s,
                          failed_reward=rc.agent_failed_reward,
                          concurrency=rc.agent_concurrency, task_reward=task_reward,
                          run_dir=self.cfg.run.dir, counters=self.agent_counters, tools=tools,
                          max_calls_per_turn=self.cfg.tools.max_calls_per_turn)

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            try:
                self._run()
            except _LearnerFinished:
                print(f"[rollout] learner finished ({self.links[0].peer_shutdown or ''}); "
                      f"stopping", flush=True)
            except ChannelError as e:
                if not self._learner_finished():
                    raise RolloutStopped(str(e)) from e
                print(f"[rollout] learner finished ({self.links[0].peer_shutdown}); stopping",
                      flush=True)
        except RolloutStopped as e:
            for link in self.links:  # tell every learner rank why, instead of a bare close
                try:
                    link.send(Shutdown(f"rollout stopped: {e}"[:4000]))
                except ChannelError:
                    pass
            raise
        finally:
            self.close()

    def _learner_finished(self, wait_s: float = 5.0) -> bool:
        """Did the learner finish normally? Rank 0 announces it before any other rank
        closes its link (Trainer._finish_together), so a closed link of another rank waits
        here (bounded) for link 0's reader to have taken that announcement."""
        deadline = time.monotonic() + wait_s
        while not (self.links[0].peer_shutdown or "").startswith(FINISHED):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _run(self) -> None:
        hello = self._recv(0, Hello)
        version, data_pos = hello.version, hello.data_pos
        if self.cfg.publish.method == "dist":
            self._open_publish_group()
        self._serve_publish(version)
        self.swaps = 0  # θ_start is no swap
        if self.schedule == "one_step_off":
            return self._one_step_off(version, data_pos)
        if self.schedule == "fully_async":
            try:
                return self.et.run(self._fully_async(version, data_pos))
            except STOPS as e:  # reward.on_error: fail; a bad row; a failed replica
                raise RolloutStopped(str(e)) from None
        while version < self.cfg.run.updates:
            batch = self._plan(version, data_pos)
            data_pos += self.rc.groups_per_batch
            for link in self.links:
                link.send(RegisterBatch(
                    version=version, objective=self.cfg.learner.objective,
                    groups=batch.groups, n_turns=self._n_turns(batch), data_pos=data_pos,
                    routing=self.cfg.routing))
            t0 = time.perf_counter()
            try:
                n_sources, reward_mean, metrics = self.et.run(self._rollout(batch))
            except STOPS as e:  # reward.on_error: fail; a bad row; a failed replica
                raise RolloutStopped(str(e)) from None
            metrics = {**metrics, **self.pending_metrics, **self.engine.take_metrics()}
            self.pending_metrics = {}
            close = CloseBatch(version=version, rollout_time_s=time.perf_counter() - t0,
                               n_sources=n_sources, reward_mean=reward_mean,
                               metrics=metrics)
            for link in self.links:
                link.send(close)
            live = self._serve_publish(version + 1, kept=version)
            if live is None:
                return  # the learner finished
            if live == version + 1 and self._eval_due(live):
                self._evaluate(live)
            version = live  # == version when the learner dropped the batch

    def close(self) -> None:
        for link in self.links:
            link.close()
        if self.pool is not None:  # 410 to its pollers, SIGTERM, SIGKILL after a grace
            try:
                self.et.run(self.pool.stop(), timeout=30)
            except Exception as e:
                print(f"[rollout] stopping the agent pool: {e}", flush=True)
        if self.oai is not None:
            try:
                self.et.run(self.oai.stop(), timeout=20)
            except Exception as e:
                print(f"[rollout] stopping the OpenAI endpoint: {e}", flush=True)
        try:
            self.et.run(self.engine.aclose())
        finally:
            self.et.close()

    # --- one batch ------------------------------------------------------------------------

    def _plan(self, version: int, data_pos: int) -> _Batch:
        groups, env_seeds, seeds, traj_ids, group_of = {}, [], [], [], []
        rows = [] if self.feed is not None else None
        for g in range(self.rc.groups_per_batch):
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

    def _drop(self, version: int, gid: str, reason: str) -> None:
        """Group `gid` leaves update `version`: every learner rank is told, once."""
        if gid in self.dropped:
            return
        self.dropped[gid] = reason
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
        kwargs = dict(max_turns=self.rc.max_turns, max_tokens_per_turn=self.rc.max_tokens_per_turn,
                      max_total_tokens=self.rc.max_total_tokens, temperature=self.rc.temperature,
                      step_timeout_s=self._step_timeout_s())
        envs = self._envs(batch)
        stats = self.feed.stats() if self.feed is not None else None
        # A group's members share their prompt: one replica serves the whole group.
        if self.turns:
            kwargs["on_turn"] = on_turn
        async for i, res in self._agents(batch, envs, kwargs):
            if not res.n_turns:  # an agent that failed before its first request
                self._drop(batch.version, batch.group_of[i],
                           f"trajectory {batch.traj_ids[i]}: its agent "
                           f"{res.extra.get('agent_status', 'ended')} before any request")
                continue
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
                continue
            src = self._trajectory(batch.traj_ids[i], gid, res, order)
            if not self._checked(batch.version, src):
                continue
            msg = TrajectoryMsg(src)
            order += 1
            if self.cfg.routing == "static":
                send(gid, msg)
                continue
            to = router.route(batch.traj_ids[i], gid, res.reward, len(res.tokens))
            for r in self._ranks_of(to.rank):
                self.links[r].send(msg)
            if to.rewards is not None:  # after its last member's message
                announce = GroupRewards(version=batch.version, group_id=gid, rewards=to.rewards)
                for d in to.announce_to:
                    for r in self._ranks_of(d):
                        self.links[r].send(announce)
        self._take_rejections(batch.version)
        ok = [r for r in rewards if isinstance(r, (int, float)) and math.isfinite(r)]
        reward_mean = sum(ok) / len(ok) if ok else None
        if stats is not None and stats.errors:  # reward.on_error: zero
            print(f"[rollout] {stats.errors} reward errors in update {batch.version}, scored 0; "
                  f"first: {stats.first_error}", flush=True)
        metrics = stats.metrics() if stats is not None else {}
        if self.oai is not None:
            metrics.update(self.oai.take_metrics())
            metrics.update(self.agent_counters.take())
        return order, reward_mean, metrics

    def _trajectory(self, traj_id: str, gid: str, res, order: int) -> TrajectorySource:
        """A finished trajectory as a source: its sampling log-probs, and the versions
        that sampled it (its oldest as policy_version; per token when several)."""
        behaviour, versions, sampled_by = span_off_policy(
            res.logprobs, res.token_versions, res.scored_mask, 0, len(res.tokens), self.loaded)
        return TrajectorySource(
            traj_id=traj_id, group_id=gid, tokens=tuple(res.tokens),
            scored_mask=tuple(res.scored_mask), reward=res.reward,
            policy_version=sampled_by, ready_order=order, prompt_len=res.prompt_len,
            behaviour_logprobs=behaviour, token_versions=versions)

    def _step_timeout_s(self) -> float:
        # The dataset env's step is the reward call, limited by reward.timeout_s itself.
        if self.rc.env == "dataset":
            return self.cfg.reward.timeout_s + 5.0
        if self.rc.env == "terminal":  # a turn's tool calls, then (last turn) the verifier
            t = self.cfg.tools
            return t.timeout_s * t.max_calls_per_turn + t.verify_timeout_s + 10.0
        return self.rc.tool_timeout_s * 2

    # --- one_step_off ---------------------------------------------------------------------

    def _one_step_off(self, v0: int, data_pos: int) -> None:
        """Batch b sampled with θ_{max(b−1, v0)}: the rollout of batch b+1 runs while the
        learner trains batch b (verl's one-step-off-policy trainer; slime's async mode)."""
        for b in range(v0, self.cfg.run.updates):
            self._catch_up(need=b - 1)
            if self.swaps and self._eval_due(self.loaded):
                self._evaluate(self.loaded)
            batch = self._plan(b, data_pos)
            data_pos += self.rc.groups_per_batch
            for link in self.links:
                link.send(RegisterBatch(
                    version=b, objective=self.cfg.learner.objective, groups=batch.groups,
                    n_turns=self._n_turns(batch), data_pos=data_pos, routing=self.cfg.routing))
            t0 = time.perf_counter()
            try:
                n_sources, reward_mean, metrics = self.et.run(self._rollout(batch))
            except STOPS as e:
                raise RolloutStopped(str(e)) from None
            metrics = {**metrics, **self.pending_metrics, **self._async_counters(0, 0),
                       **self.engine.take_metrics()}
            self.pending_metrics = {}
            close = CloseBatch(version=b, rollout_time_s=time.perf_counter() - t0,
                               n_sources=n_sources, reward_mean=reward_mean, metrics=metrics)
            for link in self.links:
                link.send(close)
        self._catch_up(need=None)  # the learner's last publications, until it finishes

    def _catch_up(self, need: int | None) -> None:
        """Load (and acknowledge) publications up to θ_need, waiting for them as needed;
        None: every one until the learner says it finished (raises _LearnerFinished). A
        later one that has arrived already waits in self.notices for the next batch: a
        streaming learner often publishes θ_b before batch b starts, and loading it would
        make batch b on-policy, not one step off."""
        link = self.links[0]
        while need is None or self.loaded < need:
            msg = (self.notices.pop(0) if self.notices
                   else link.recv(timeout_s=self.cfg.channel.timeout_s))
            if not isinstance(msg, Publish):
                self._on_learner_message(msg, -1)
                continue
            self._check_publish(msg)
            self.et.run(self._reload(msg))

    def _async_counters(self, dropped: int, partial: int) -> dict[str, float]:
        counters = {"async/dropped_stale_groups": dropped, "async/partial_sources": partial,
                    "async/weight_swaps": self.swaps}
        self.swaps = 0
        return counters

    # --- fully_async ----------------------------------------------------------------------

    async def _fully_async(self, v0: int, data_pos: int) -> None:
        """Generate continuously; register batch k once a batch worth of groups completed."""
        cap = self.rc.max_groups_in_flight or self.rc.groups_per_batch
        s, per_batch = self.cfg.learner.max_staleness, self.rc.groups_per_batch
        former = BatchFormer(per_batch, s)
        running: dict[asyncio.Task, int] = {}  # group task → its data position
        pos, live, k = data_pos, 0, v0  # next data position; groups started, not dropped
        next_data_pos = data_pos  # RegisterBatch.data_pos: past every group used or dropped
        dropped, t0 = 0, time.perf_counter()
        try:
            while k < self.cfg.run.updates:
                await self._take_notices()
                while len(running) < cap and may_start(live, self.loaded, v0, s, per_batch):
                    running[asyncio.ensure_future(self._group(pos))] = pos
                    pos, live = pos + 1, live + 1
                groups, stale = former.take(k)
                for g in stale:
                    print(f"[rollout] dropped group {g.group_id} (data position {g.pos}): "
                          f"sampled by θ_{g.oldest}, more than learner.max_staleness={s} "
                          f"behind update {k}", flush=True)
                    next_data_pos = max(next_data_pos, g.pos + 1)
                dropped, live = dropped + len(stale), live - len(stale)
                if groups:
                    next_data_pos = max(next_data_pos, *(g.pos + 1 for g in groups))
                    self._send_batch(k, groups, next_data_pos, dropped, time.perf_counter() - t0)
                    k, dropped, t0 = k + 1, 0, time.perf_counter()
                    continue
                if not running:
                    await asyncio.sleep(0.005)  # held back by the staleness bound
                    continue
                done, _ = await asyncio.wait(running, timeout=0.005,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    running.pop(task)
                    group = task.result()  # a failure stops the run (as in run_batch)
                    if group is None:
                        live -= 1  # invalid: dropped (said why), not stale
                    else:
                        former.add(group)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        while True:  # the learner's last publications, until it finishes
            await self._take_notices()
            await asyncio.sleep(0.005)

    async def _take_notices(self) -> None:
        """Every message the learners sent: a Publish is loaded at once, mid-request (abort
        and continue, so versions stay exact per token), and acknowledged."""
        for link in self.links:
            while (msg := link.poll()) is not None:
                self._on_learner_message(msg, -1)  # Publish → self.notices
        while self.notices:
            msg = self._check_publish(self.notices.pop(0))
            await self._reload(msg, mode="abort")

    async def _group(self, pos: int) -> Group | None:
        """One GRPO group at data position `pos`, its members' sources built as they end;
        None if a member fails the source checks (said why)."""
        gid, m = f"d{pos}", self.rc.group_size
        tids = [f"{gid}-t{i}" for i in range(m)]
        seeds = [hash((self.cfg.seed, pos, i)) & 0x7FFFFFFF for i in range(m)]
        rows = [self.feed.train_row(pos)] * m if self.feed is not None else None
        envs = self._envs(_Batch(0, {}, [], [], tids, [gid] * m, rows), salt=pos)
        kwargs = dict(max_turns=self.rc.max_turns, max_tokens_per_turn=self.rc.max_tokens_per_turn,
                      max_total_tokens=self.rc.max_total_tokens, temperature=self.rc.temperature,
                      step_timeout_s=self._step_timeout_s())
        members, stats = [], self.feed.stats() if self.feed is not None else None
        async for i, res in run_batch(self.engine, envs, seeds=seeds, env_seeds=[pos] * m,
                                      routes=[gid] * m, **kwargs):
            if stats is not None:
                stats.add(envs[i])
            src = self._trajectory(tids[i], gid, res, 0)
            try:
                validate_source(src, self.vocab_size, self.max_tokens)
            except SourceError as e:
                print(f"[rollout] dropped group {gid}: {e}", flush=True)
                return None
            members.append(src)
        return Group(gid, pos, members, min(x.policy_version for x in members))

    def _send_batch(self, k: int, groups: list[Group], data_pos: int, dropped: int,
                    rollout_s: float) -> None:
        """Register batch k with these completed groups, send their sources, close it."""
        self.dropped = {}
        self._take_rejections(k)
        plan = {g.group_id: [x.traj_id for x in g.members] for g in groups}
        for link in self.links:
            link.send(RegisterBatch(version=k, objective=self.cfg.learner.objective,
                                    groups=plan, n_turns={}, data_pos=data_pos,
                                    routing=self.cfg.routing))
        batch = _Batch(k, plan, [], [], [], [])
        owners = self._owners(batch)
        router = BalancedRouter(plan, self.rc.n_learners // self.tp)
        order, partial, rewards = 0, 0, []
        for g in groups:
            for src in g.members:
                self._take_rejections(k)
                if g.group_id in self.dropped:
                    break
                src = dataclasses.replace(src, ready_order=order)
                order += 1
                partial += bool(src.token_versions)
                rewards.append(src.reward)
                msg = TrajectoryMsg(src)
                if self.cfg.routing == "static":
                    for r in owners[g.group_id]:
                        self.links[r].send(msg)
                    continue
                to = router.route(src.traj_id, g.group_id, src.reward, len(src.tokens))
                for r in self._ranks_of(to.rank):
                    self.links[r].send(msg)
                if to.rewards is not None:
                    announce = GroupRewards(version=k, group_id=g.group_id, rewards=to.rewards)
                    for d in to.announce_to:
                        for r in self._ranks_of(d):
                            self.links[r].send(announce)
        self._take_rejections(k)
        ok = [r for r in rewards if math.isfinite(r)]
        metrics = {**self._async_counters(dropped, partial), **self.pending_metrics,
                   **self.engine.take_metrics()}
        self.pending_metrics = {}
        close = CloseBatch(version=k, rollout_time_s=rollout_s, n_sources=order,
                           reward_mean=sum(ok) / len(ok) if ok else None, metrics=metrics)
        for link in self.links:
            link.send(close)

    # --- evaluation -----------------------------------------------------------------------

    def _eval_due(self, version: int) -> bool:
        every = self.cfg.run.eval_every
        return bool(every) and self.feed is not None and version % every == 0

    def _evaluate(self, version: int) -> None:
        """θ_version on data.eval, after its publication was acknowledged and before the
        next RegisterBatch: the learner's step clock starts at that registration, so
        evaluation is not in any step time. Results go into the next CloseBatch's metrics
        and, at once, to RUN/eval.jsonl (the last evaluation has no next batch)."""
        t0 = time.perf_counter()

        def agents(envs, seeds, rows, traj_ids, routes, kwargs):  # the batch's agents too
            b = _Batch(version, {}, rows, seeds, traj_ids, routes, rows)
            return self._agents(b, envs, kwargs, prompts=self.feed.eval)

        try:
            metrics = self.et.run(self.feed.evaluate(
                self.engine, version, agents=agents if self.oai is not None else None))
        except STOPS as e:
            raise RolloutStopped(f"evaluation of θ_{version}: {e}") from None
        finally:
            self.engine.take_metrics()  # the replicas' counts are training's only
        if self.oai is not None:  # and so are the endpoint's; the agents' failures are named
            self.oai.take_metrics()
            metrics["eval/agent_failures"] = self.agent_counters.take()["rollout/agent_failures"]
        metrics["eval/time_s"] = time.perf_counter() - t0
        metrics["eval/policy_version"] = version
        self.pending_metrics = metrics
        print(f"[rollout] eval θ_{version}: " + json.dumps(metrics), flush=True)
        os.makedirs(self.cfg.run.dir, exist_ok=True)
        with open(os.path.join(self.cfg.run.dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")

    # --- publication (tsync_mcore.publication.receive) ------------------------------------

    def _serve_publish(self, version: int, kept: int | None = None) -> int | None:
        """receive.serve: wait for θ_version, reload it, acknowledge; the version now served
        (`kept` again for a dropped batch), None once the learner says it finished."""
        return receive.serve(self.links[0], version, self.cfg.channel.timeout_s,
                             publish.resolve_dir(self.cfg.publish, self.cfg.run.dir),
                             lambda msg: self.et.run(self._reload(msg)), kept=kept,
                             method=publish.method_of(self.cfg.publish))

    async def _reload(self, msg: Publish, mode: str = "keep") -> None:
        """receive.reload into every replica, acknowledged; a failed reload is told to the
        learner (naming the replica) and stops the rollout."""
        def loaded(version: int) -> None:
            self.loaded = version
            self.swaps += 1  # once per publication, however many replicas loaded it

        await receive.reload(self.engine, self.links[0], msg, mode=mode, on_loaded=loaded,
                             named=(ReplicaError,))

    def _check_publish(self, msg) -> Publish:
        """A notice taken between or during batches: θ_{loaded+1}, checked."""
        return check_publish(self.links[0], msg, self.loaded + 1,
                             publish.resolve_dir(self.cfg.publish, self.cfg.run.dir),
                             method=publish.method_of(self.cfg.publish))

    def _open_publish_group(self) -> None:
        """publish.method: dist: receive.open_group (the learner joins as rank 0)."""
        self._publish_store = receive.open_group(self.cfg, self.links[0], self.engine, self.et)

    def _recv(self, rank: int, kind: type):
        msg = self.links[rank].recv(timeout_s=self.cfg.channel.timeout_s)
        if not isinstance(msg, kind):
            raise RolloutStopped(f"expected {kind.__name__} from learner rank {rank}, "
                                 f"got {type(msg).__name__}")
        return msg
