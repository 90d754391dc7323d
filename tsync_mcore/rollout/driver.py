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

Here: setup (engines, the OpenAI endpoint, the channel), the hello, and the schedule's loop
(rollout.schedules: functions over a rollout.batch.BatchRunner, which runs one batch and
returns its BatchOutcome). The parts: plan (a batch's groups and environments), agents (who
runs trajectories), sources (a trajectory as sources), learners (sending and taking
messages), served (the policy version served, publications loaded: the receiving side is
tsync_mcore.publication.receive), evaluation.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoTokenizer

from tsync_mcore.channel import ChannelError, Hello, channel_secret, open_rollout_side
from tsync_mcore.config import Config
from tsync_mcore.objectives import OBJECTIVES
from tsync_mcore.publication import receive
from tsync_mcore.publication import send as publish
# RolloutStopped and the publication checks live with the rest of the receiving side
from tsync_mcore.publication.receive import (RolloutStopped, await_publish,  # noqa: F401
                                             check_publish)
from tsync_mcore.rewards.judge import JudgeLimitsError
from tsync_mcore.rollout.agents import Agents
from tsync_mcore.rollout.batch import BatchRunner
from tsync_mcore.rollout.engine import EngineThread, RolloutEngine, TeacherScorer
from tsync_mcore.rollout.evaluation import Evaluator
from tsync_mcore.rollout.feed import DataFeed
from tsync_mcore.rollout.learners import LearnerFinished, LearnerLinks
from tsync_mcore.rollout.replicas import (ReplicaError, ReplicaSet, cpu_memory_note,
                                          start_replicas)
from tsync_mcore.rollout.schedules import run_schedule
from tsync_mcore.rollout.served import ServedPolicy
from tsync_mcore.util.safe_files import check_hf_dir

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # rollout.dtype → vLLM's name


class RolloutDriver:
    """The rollout process: its engines, endpoint and links, started from `cfg`; `run()`
    serves the learner until it finishes, then closes them."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rc = cfg.rollout
        # The objective's source kind decides what is sent: whole trajectories when their
        # reward is fixed, or each turn once the teacher has scored it.
        turns = OBJECTIVES[cfg.learner.objective].source == "turn"
        # vLLM and transformers read these dirs later with tracebacks of their own; a broken
        # config.json or truncated shard is named here, in one line, before anything starts.
        check_hf_dir(cfg.model.hf_dir)
        if turns and self.rc.teacher_dir:
            check_hf_dir(self.rc.teacher_dir)
        if cfg.reward.function == "judge" and self.rc.env == "dataset":
            check_hf_dir(cfg.reward.judge.model_dir)
        # Datasets and the reward function are checked before the channel opens: a bad row
        # or spec stops here in one line, not after the learners joined.
        self.feed = DataFeed(cfg) if self.rc.env not in ("toy", "terminal") else None
        ch = cfg.channel
        links = open_rollout_side(ch.listen_addr or ch.addr, ch.port, self.rc.n_learners,
                                  timeout_s=ch.timeout_s, realtime_io=ch.realtime_io,
                                  secret=channel_secret(cfg), join_timeout_s=ch.join_timeout_s)
        self.tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
        if self.feed is not None:
            self.feed.attach(self.tok)
        # Sources are checked here as the learner checks them, so a bad one (a broken reward
        # function, an engine emitting ids outside the vocabulary) drops its group before
        # any of it is sent, instead of reaching a learner rank.
        hf = AutoConfig.from_pretrained(cfg.model.hf_dir)
        positions = getattr(hf, "max_position_embeddings", None) or 4096  # as the learner's bridge
        self.links = LearnerLinks(links, cfg, vocab_size=hf.vocab_size,
                                  max_tokens=min(positions, cfg.learner.max_tokens or positions))
        self.et = EngineThread()
        self.engine: ReplicaSet = self.et.run(self._make_engine())
        self.judge_engine: RolloutEngine | None = None
        if self.feed is not None and self.feed.judge is not None:
            self._start_judge()
        self.policy = ServedPolicy(links[0], self.engine, self.et, timeout_s=ch.timeout_s,
                                   publish_dir=publish.resolve_dir(cfg.publish, cfg.run.dir),
                                   method=publish.method_of(cfg.publish))
        self.agents = Agents(cfg, self.engine, self.tok, self.feed, self.et,
                             served=lambda: self.policy.loaded)
        teacher = TeacherScorer(self.rc.teacher_dir) if turns else None
        if self.rc.agent == "openai":
            self.agents.start_endpoint()
        if turns and not self.rc.teacher_dir:
            raise RolloutStopped("OPD needs rollout.teacher_dir (the frozen teacher's HF "
                                 "directory)")
        self.runner = BatchRunner(cfg, self.engine, self.links, self.feed, agents=self.agents,
                                  policy=self.policy, et=self.et, tok=self.tok,
                                  teacher=teacher)
        self.evaluator = Evaluator(cfg, self.engine, self.feed, self.agents, self.et)
        self.publish_store = None  # publish.method: dist: the group's store and Seal, kept

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
                                 else None, structured_regex=self.rc.structured_regex)

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
        except JudgeLimitsError as e:  # its context cannot hold what the policy may write
            self._stop_engines()
            raise RolloutStopped(str(e)) from None
        except Exception as e:  # a bad directory, no chat template, vLLM refusing it
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self._stop_engines()
            raise RolloutStopped(f"reward.judge.model_dir {jc.model_dir!r}: the judge engine "
                                 f"did not start: {type(e).__name__}: {first}") from None

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Serve the learner until it finishes; RolloutStopped (told to every learner rank)
        when it cannot go on."""
        try:
            try:
                self._run()
            except LearnerFinished:
                print(f"[rollout] learner finished ({self.links.links[0].peer_shutdown or ''}); "
                      f"stopping", flush=True)
            except ChannelError as e:
                if not self.links.learner_finished():
                    raise RolloutStopped(str(e)) from e
                print(f"[rollout] learner finished ({self.links.links[0].peer_shutdown}); "
                      f"stopping", flush=True)
        except RolloutStopped as e:
            self.links.shutdown(f"rollout stopped: {e}")
            raise
        finally:
            self.close()

    def _run(self) -> None:
        hello = self.links.expect(0, Hello)
        version, data_pos = hello.version, hello.data_pos
        if self.cfg.publish.method == "dist":  # receive.open_group: the learner is rank 0
            self.publish_store = receive.open_group(self.cfg, self.links.links[0], self.engine,
                                                    self.et)
        if self.cfg.run.eval_first and version == 0 and self.feed is not None:
            # The engine serves θ_0 from model.hf_dir already; evaluating before the learner's
            # first publication is acknowledged keeps it out of every step clock (an
            # asynchronous step counts from that acknowledgement).
            self.evaluator.evaluate(version)
        self.policy.serve(version)
        self.policy.take_swaps()  # θ_start is no swap
        run_schedule(self.runner, self.evaluator, version, data_pos)

    def close(self) -> None:
        self.links.close_all()
        self.agents.stop()
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
