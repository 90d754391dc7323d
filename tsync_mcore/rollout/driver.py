"""The rollout process: vLLM engine + agent loop, streaming ready sources to the learners.

    hello ← learner rank 0 (resume point)   reload θ_start, ack
    per update k:
      RegisterBatch → every learner rank (the groups of batch k and the routing)
      launch every trajectory at once; each one is sent to a learner rank the moment its
      reward is fixed (GRPO: balanced routing picks the least-loaded rank, and a split
      group's rewards go to the ranks holding its members once its last one is in) — or
      each turn to its group's owner the moment the teacher scored it (OPD). A source
      that fails validation here, or that a learner rank rejects (Rejected), drops its
      group: DropGroup → every rank, and nothing more of the group is sent
      CloseBatch → every rank; wait for Publish(θ_{k+1}) (a path under run.publish_dir, or the
      rollout stops), reload in place, reset the prefix
      cache, Ack. Only then does batch k+1 start.
A learner that dies or stops surfaces here as PeerGone/ChannelTimeout: the rollout stops
cleanly with that reason instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from tsync_mcore.channel import (Ack, ChannelError, CloseBatch, DropGroup, GroupRewards, Hello,
                                 Link, PeerGone, Publish, RegisterBatch, Rejected, Shutdown,
                                 TrajectoryMsg, TurnMsg, channel_secret,
                                 open_rollout_side)
from tsync_mcore import publish
from tsync_mcore.config import Config
from tsync_mcore.objectives import OBJECTIVES
from tsync_mcore.rollout.agent import run_batch
from tsync_mcore.rollout.engine import EngineThread, RolloutEngine, TeacherScorer
from tsync_mcore.rollout.envs import SkyRLGymAdapter, ToyToolConfig, ToyToolEnv
from tsync_mcore.rollout.feed import DataFeed
from tsync_mcore.rewards import RewardFailed
from tsync_mcore.data import DataError
from tsync_mcore.routing import BalancedRouter
from tsync_mcore.safe_files import check_hf_dir
from tsync_mcore.sources import (BatchPlan, SourceError, TrajectorySource, TurnSource,
                                 assign_groups, validate_source, validate_turn)


VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # rollout.dtype → vLLM's name
FINISHED = "learner finished"  # reason prefix of the learner's Shutdown after its last update


class RolloutStopped(RuntimeError):
    """The rollout stopped before the learner finished; the message says why."""


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
        self.feed = DataFeed(cfg) if self.rc.env != "toy" else None
        self.pending_metrics: dict = {}  # evaluation results for the next CloseBatch
        ch = cfg.channel
        self.links: list[Link] = open_rollout_side(ch.addr, ch.port, self.rc.n_learners,
                                                   timeout_s=ch.timeout_s,
                                                   realtime_io=ch.realtime_io,
                                                   secret=channel_secret(cfg))
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
        self.et = EngineThread()
        self.engine: RolloutEngine = self.et.run(self._make_engine())
        self.teacher = TeacherScorer(self.rc.teacher_dir) if self.turns else None
        if self.turns and not self.rc.teacher_dir:
            raise RolloutStopped("OPD needs rollout.teacher_dir (the frozen teacher's HF "
                                 "directory)")

    async def _make_engine(self) -> RolloutEngine:
        gpu = torch.cuda.is_available()
        engine = RolloutEngine(self.cfg.model.hf_dir, seed=self.cfg.seed,
                               kv_cache_gib=self.rc.kv_cache_gib,
                               max_model_len=max(self.rc.max_total_tokens, 64),
                               dtype=VLLM_DTYPES[self.rc.dtype],  # resolved: auto → model.dtype
                               tensor_parallel_size=self.rc.tp,
                               gpu_memory_utilization=self.rc.gpu_memory_utilization if gpu
                               else None)
        await engine.warmup()
        return engine

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            hello = self._recv(0, Hello)
            version, data_pos = hello.version, hello.data_pos
            self._serve_publish(version)
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
                except (RewardFailed, DataError) as e:  # reward.on_error: fail; a bad row
                    raise RolloutStopped(str(e)) from None
                metrics, self.pending_metrics = {**metrics, **self.pending_metrics}, {}
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
        except ChannelError as e:
            raise RolloutStopped(str(e)) from e
        except RolloutStopped as e:
            for link in self.links:  # tell every learner rank why, instead of a bare close
                try:
                    link.send(Shutdown(f"rollout stopped: {e}"[:4000]))
                except ChannelError:
                    pass
            raise
        finally:
            self.close()

    def close(self) -> None:
        for link in self.links:
            link.close()
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

    def _envs(self, batch: _Batch) -> list:
        n = len(batch.traj_ids)
        if self.feed is not None:
            return self.feed.train_envs(batch.rows, batch.traj_ids)
        if self.rc.env == "toy":
            conf = ToyToolConfig(max_turns=self.rc.max_turns,
                                 latency_median_s=self.rc.tool_latency_s,
                                 tool_timeout_s=self.rc.tool_timeout_s)
            return [ToyToolEnv(self.tok, conf, latency_rng=random.Random(i)) for i in range(n)]
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
            return
        if isinstance(msg, Shutdown):
            raise RolloutStopped(f"learner shut down: {msg.reason}")
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
                              mask: list[int]) -> None:
                nonlocal order
                span = tokens[start:end]
                scored = [p for p in range(start, end) if mask[p]]
                teacher = await self.teacher.ascore(tokens[:end], scored)
                lp = [None] * (end - start)
                for p, v in zip(scored, teacher):
                    lp[p - start] = v
                src = TurnSource(
                    traj_id=tid, group_id=gid, turn=turn, n_turns=self.rc.max_turns,
                    start=start, tokens=tuple(span),
                    scored_mask=tuple(mask[start:end]), teacher_logprobs=tuple(lp),
                    policy_version=batch.version, ready_order=order,
                    prompt_len=None)
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
        async for i, res in run_batch(self.engine, envs, seeds=batch.seeds,
                                      env_seeds=batch.env_seeds,
                                      on_turn=on_turn if self.turns else None, **kwargs):
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
            src = TrajectorySource(
                traj_id=batch.traj_ids[i], group_id=gid, tokens=tuple(res.tokens),
                scored_mask=tuple(res.scored_mask), reward=res.reward,
                policy_version=batch.version, ready_order=order, prompt_len=res.prompt_len)
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
        return order, reward_mean, (stats.metrics() if stats is not None else {})

    def _step_timeout_s(self) -> float:
        # The dataset env's step is the reward call, limited by reward.timeout_s itself.
        if self.rc.env == "dataset":
            return self.cfg.reward.timeout_s + 5.0
        return self.rc.tool_timeout_s * 2

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
        try:
            metrics = self.et.run(self.feed.evaluate(self.engine, version))
        except (RewardFailed, DataError) as e:
            raise RolloutStopped(f"evaluation of θ_{version}: {e}") from None
        metrics["eval/time_s"] = time.perf_counter() - t0
        metrics["eval/policy_version"] = version
        self.pending_metrics = metrics
        print(f"[rollout] eval θ_{version}: " + json.dumps(metrics), flush=True)
        os.makedirs(self.cfg.run.dir, exist_ok=True)
        with open(os.path.join(self.cfg.run.dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")

    # --- publication ----------------------------------------------------------------------

    def _serve_publish(self, version: int, kept: int | None = None) -> int | None:
        """Wait for θ_version from learner rank 0, reload it, acknowledge; returns the
        version now served, None once the learner says it finished. A notice for `kept`
        (the version already loaded) means the learner dropped the batch without stepping
        (a non-finite gradient): the weights stay, and the next batch is for `kept` again."""
        msg = await_publish(self.links[0], version, self.cfg.channel.timeout_s,
                            publish.resolve_dir(self.cfg.run), kept=kept)
        if msg is None:
            return None
        if msg.version == kept:
            print(f"[rollout] learner dropped the batch of version {kept} (non-finite "
                  f"gradient); θ_{kept} stays loaded", flush=True)
            self.links[0].send(Ack(version=kept, ok=True, reload_time_s=0.0))
            return kept
        try:
            seconds = self.et.run(self.engine.reload_weights(msg.path))
        except Exception as e:  # tell the learner; it must not train on the old policy
            self.links[0].send(Ack(version=version, ok=False, error=f"reload failed: {e}"))
            raise RolloutStopped(f"reload of {msg.path} failed: {e}") from e
        self.links[0].send(Ack(version=version, ok=True, reload_time_s=seconds))
        return version

    def _recv(self, rank: int, kind: type):
        msg = self.links[rank].recv(timeout_s=self.cfg.channel.timeout_s)
        if not isinstance(msg, kind):
            raise RolloutStopped(f"expected {kind.__name__} from learner rank {rank}, "
                                 f"got {type(msg).__name__}")
        return msg


def await_publish(link: Link, version: int, timeout_s: float, publish_dir: str,
                  kept: int | None = None) -> Publish | None:
    """The Publish of θ_version (or of `kept`, a dropped batch's θ_k again) from learner
    rank 0's link, checked: its version, and exactly this version's file in the private
    `publish_dir` (publish.resolve_dir), so a learner can only make the rollout load what the
    learners publish. None once the learner says it finished; RolloutStopped for anything
    else (a wrong version or path is told to the learner with a failed Ack)."""
    try:
        msg = link.recv(timeout_s=timeout_s)
        while isinstance(msg, Rejected):  # after the close: the learners agree on it
            print(f"[rollout] learner rejected {msg.source} of update {msg.version} after "
                  f"the batch closed: {msg.reason}", flush=True)
            msg = link.recv(timeout_s=timeout_s)
    except PeerGone:
        if (link.peer_shutdown or "").startswith(FINISHED):
            return None
        raise
    if isinstance(msg, Shutdown):
        if msg.reason.startswith(FINISHED):
            return None
        raise RolloutStopped(f"learner shut down: {msg.reason}")
    if not isinstance(msg, Publish):
        raise RolloutStopped(f"expected Publish, got {type(msg).__name__}")
    if msg.version != version and msg.version != kept:
        link.send(Ack(version=msg.version, ok=False, error=f"rollout expected version {version}"))
        raise RolloutStopped(f"learner published version {msg.version}, expected {version}")
    why = _outside(msg.path, publish_dir)
    want = publish.path_for(publish_dir, msg.version)
    if not why and os.path.realpath(msg.path) != os.path.realpath(want):
        why = (f"learner published {msg.path}, this rollout loads {want} (both must run the "
               f"same config from the same directory)")
    if not why:
        try:
            publish.check_private_dir(publish_dir)
        except publish.PublishDirError as e:
            why = str(e)
    if why:
        link.send(Ack(version=msg.version, ok=False, error=why))
        raise RolloutStopped(why)
    return msg


def _outside(path: str, publish_dir: str) -> str | None:
    """Why `path` is not a file name under `publish_dir` (realpaths compared), or None."""
    if not path or "\0" in path:
        return f"published path {path!r} is not a file name; expected one under run.publish_dir"
    root, real = os.path.realpath(publish_dir), os.path.realpath(path)
    if real == root or os.path.commonpath([real, root]) != root:
        return (f"published path {path!r} resolves to {real}, outside run.publish_dir {root}: "
                f"refusing to load it")
    return None
