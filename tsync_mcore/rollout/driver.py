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

The asynchronous schedules (docs/design/async.md) keep the messages and change when they go:
  one_step_off: batch b is sampled with θ_{max(b−1, v0)}. Between batches every Publish
      that has arrived is reloaded and acknowledged; the loop blocks only while the loaded
      version is below b − 1.
  fully_async: groups are generated continuously (rollout.max_groups_in_flight at once,
      AReaL's staleness bound); a Publish is loaded as soon as it arrives, mid-request
      (abort and continue: every token keeps the version that sampled it). Batch k is
      registered once a batch worth of groups has completed, in completion order; a group
      older than learner.max_staleness at that point is dropped and counted, never sent.
Every source carries its sampling log-probs (behaviour_logprobs) on every schedule.

Here: setup (engines, the OpenAI endpoint, the channel) and dispatch. The schedule loops are
in tsync_mcore.rollout.schedules, one batch (plan, agents, checks, routing) in
tsync_mcore.rollout.batch, evaluation in tsync_mcore.rollout.evaluation, and awaiting,
checking, reloading and acknowledging a publication in tsync_mcore.publication.receive.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from tsync_mcore.channel import (ChannelError, Hello, Link, Publish, Shutdown, channel_secret,
                                 open_rollout_side)
from tsync_mcore.config import Config
from tsync_mcore.objectives import OBJECTIVES
from tsync_mcore.publication import receive
from tsync_mcore.publication import send as publish
# RolloutStopped and the publication checks live with the rest of the receiving side
from tsync_mcore.publication.receive import (FINISHED, RolloutStopped,  # noqa: F401
                                             await_publish, check_publish)
from tsync_mcore.rollout.batch import STOPS, BatchWork, _Batch, _LearnerFinished  # noqa: F401
from tsync_mcore.rollout.engine import EngineThread, RolloutEngine, TeacherScorer
from tsync_mcore.rollout.envs import ToyToolEnv
from tsync_mcore.rollout.evaluation import Evaluation
from tsync_mcore.rollout.feed import DataFeed
from tsync_mcore.rollout.loop import run_batch
from tsync_mcore.rollout.replicas import (ReplicaError, ReplicaSet, cpu_memory_note,
                                          start_replicas)
from tsync_mcore.rollout.schedules import Schedules
from tsync_mcore.util.safe_files import check_hf_dir

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # rollout.dtype → vLLM's name


class RolloutDriver(BatchWork, Schedules, Evaluation):
    """Setup (engines, the OpenAI endpoint, the channel) and dispatch: the schedule loops
    (rollout.schedules), one batch (rollout.batch), evaluation (rollout.evaluation) and
    the receiving side of publication (publication.receive) are its parts."""

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
        if cfg.reward.function == "judge" and self.rc.env == "dataset":
            check_hf_dir(cfg.reward.judge.model_dir)
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
        self.judge_engine: RolloutEngine | None = None
        if self.feed is not None and self.feed.judge is not None:
            self._start_judge()
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
                                 max_num_seqs=self.rc.max_num_seqs,
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
            engine = start_replicas(self.rc.replicas, make, tp=self.rc.tp,
                                    max_restarts=self.rc.max_replica_restarts,
                                    hang_s=self.rc.replica_hang_s)
        except ReplicaError as e:
            raise RolloutStopped(str(e)) from e
        try:
            await engine.warmup()
        except BaseException:
            await engine.aclose()
            raise
        engine.take_metrics()  # warm-up requests are no update's
        return engine

    def _start_judge(self) -> None:
        """reward.function 'judge': its own vLLM engine on the rollout's loop, beside the
        replicas but not one of them: no publication reaches it, no policy request is
        routed to it (rewards/judge.py)."""
        jc, gpu = self.cfg.reward.judge, torch.cuda.is_available()
        share = self.rc.gpu_memory_utilization + jc.gpu_memory_utilization
        if gpu and share > 1.0:  # both engines on the rollout's first GPU
            self._stop_engines()
            raise RolloutStopped(f"reward.judge.gpu_memory_utilization "
                                 f"{jc.gpu_memory_utilization} + rollout.gpu_memory_utilization "
                                 f"{self.rc.gpu_memory_utilization} = {share:g} of one GPU: "
                                 f"lower rollout.gpu_memory_utilization to leave the judge room")
        try:
            tok = AutoTokenizer.from_pretrained(jc.model_dir)

            async def start() -> RolloutEngine:
                return RolloutEngine(jc.model_dir, seed=self.cfg.seed,
                                     kv_cache_gib=self.rc.kv_cache_gib,
                                     max_num_seqs=jc.max_num_seqs,
                                     max_model_len=jc.max_model_len or None,
                                     dtype=VLLM_DTYPES[self.rc.dtype],
                                     gpu_memory_utilization=jc.gpu_memory_utilization
                                     if gpu else None)

            self.judge_engine = self.et.run(start())
            self.et.run(self.judge_engine.warmup())  # its first requests' cost: no batch's
            self.feed.judge.attach(self.judge_engine, tok)
        except Exception as e:  # a bad directory, no chat template, vLLM refusing it
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self._stop_engines()
            raise RolloutStopped(f"reward.judge.model_dir {jc.model_dir!r}: the judge engine "
                                 f"did not start: {type(e).__name__}: {first}") from None

    def _engine_metrics(self) -> dict:
        """The replicas' counters, and the judge's (reward/judge_*) since the last call."""
        out = self.engine.take_metrics()
        if self.feed is not None and self.feed.judge is not None:
            out.update(self.feed.judge.take_metrics())
        return out

    def _start_openai(self) -> None:
        """rollout.agent: openai: the OpenAI-compatible endpoint on the engine's loop
        (docs/guide/agents.md), with a random key for this run."""
        import secrets

        from tsync_mcore.rollout.openai.processes import AgentCounters
        from tsync_mcore.rollout.openai.server import OpenAIServer

        self.oai = OpenAIServer(self.engine, self.tok, api_key=secrets.token_urlsafe(24),
                                model=os.path.basename(os.path.normpath(self.cfg.model.hf_dir)),
                                history=self.rc.openai_history, temperature=self.rc.temperature,
                                current_version=lambda: self.loaded,
                                max_body_bytes=int(self.rc.openai_max_body_mb * (1 << 20)),
                                max_messages=self.rc.openai_max_messages,
                                read_timeout_s=self.rc.openai_read_timeout_s)
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
                                                       VERIFIERS_COMMAND, run_agents)
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
        vf = self.feed.vf if self.feed is not None else None
        if vf is not None:  # the agent runs the env's rollout on this row of its dataset
            split = "eval" if prompts is not None and prompts is self.feed.eval else "train"
            for t, r in zip(tasks, batch.rows):
                t["verifiers"] = {"env": vf, "args": self.cfg.verifiers.args,
                                  "split": split, "row": r}

        def reward_error(i: int, why: str) -> float:
            """Trajectory i's agent could not score it: reward.on_error decides."""
            env = envs[i]
            if hasattr(env, "reward_error"):
                return env.reward_error(why)
            from tsync_mcore.rewards import RewardFailed
            msg = f"the agent's reward on trajectory {batch.traj_ids[i]}: {why}"
            if self.cfg.reward.on_error == "fail":
                raise RewardFailed(msg)
            print(f"[rollout] {msg}; scored 0", flush=True)
            return 0.0

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

        command = rc.agent_command or (TERMINAL_COMMAND if rc.env == "terminal" else
                                       VERIFIERS_COMMAND if vf is not None else DEFAULT_COMMAND)
        if rc.agent_pool and self.pool is None:  # started with the first batch, kept
            self.pool = AgentPool(self.oai, command=command, size=rc.agent_pool,
                                  run_dir=self.cfg.run.dir, timeout_s=rc.agent_timeout_s,
                                  counters=self.agent_counters, pass_env=rc.agent_env)
        return run_agents(self.oai, traj_ids=batch.traj_ids, group_of=batch.group_of,
                          tasks=tasks, seeds=batch.seeds, version=self.loaded, limits=limits,
                          command=command, pool=self.pool, timeout_s=rc.agent_timeout_s,
                          failed_reward=rc.agent_failed_reward,
                          concurrency=rc.agent_concurrency, task_reward=task_reward,
                          run_dir=self.cfg.run.dir, counters=self.agent_counters, tools=tools,
                          max_calls_per_turn=self.cfg.tools.max_calls_per_turn,
                          pass_env=rc.agent_env, on_reward_error=reward_error)

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
        if self.cfg.run.eval_first and version == 0 and self.feed is not None:
            # The engine serves θ_0 from model.hf_dir already; evaluating before the learner's
            # first publication is acknowledged keeps it out of every step clock (an
            # asynchronous step counts from that acknowledgement).
            self._evaluate(version)
        self._serve_publish(version)
        self.swaps = 0  # θ_start is no swap
        if self.schedule == "one_step_off":
            return self._one_step_off(version, data_pos)
        if self.schedule == "fully_async":
            try:
                return self.et.run(self._fully_async(version, data_pos))
            except STOPS as e:  # reward.on_error: fail; a bad row; a failed replica
                raise RolloutStopped(str(e)) from None
        return self._sync(version, data_pos)

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
        self._stop_engines()

    def _stop_engines(self) -> None:
        try:
            try:
                if self.judge_engine is not None:
                    self.feed.judge.close()
                    self.et.run(self.judge_engine.aclose())
            finally:
                self.et.run(self.engine.aclose())
        finally:
            self.et.close()

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
            print(f"[rollout] serving θ_{version}", flush=True)
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
        # (the store and its Seal: kept for the run)

    def _recv(self, rank: int, kind: type):
        msg = self.links[rank].recv(timeout_s=self.cfg.channel.timeout_s)
        if not isinstance(msg, kind):
            raise RolloutStopped(f"expected {kind.__name__} from learner rank {rank}, "
                                 f"got {type(msg).__name__}")
        return msg
