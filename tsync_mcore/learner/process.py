"""The learner process loop: channel in, one update per batch, publication out.

    hello (rank 0: resume point) → publish θ_start → per update k:
      RegisterBatch → sources stream in and are served as they arrive → CloseBatch
      → close: reduce, clip, one optimizer step → publish θ_{k+1} and wait for the
      rollout's acknowledgement (rank 0) → metrics, checkpoint
The other ranks need not wait for the acknowledgement: the rollout registers batch k+1
only after it has reloaded θ_{k+1}, so their next receive is the barrier.

The asynchronous schedules (one_step_off, fully_async; docs/design/async.md) publish θ_{k+1}
without waiting: batch k+1 is usually queued already, sampled by an older θ. Rank 0 takes
the acknowledgements whenever they arrive, in or between batches, each checked against the
oldest version still unacknowledged; the files of those versions stay until then, and the
run ends only once every published version is acknowledged.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import yaml

from tsync_mcore.learner import checkpoint

from tsync_mcore.learner import export

from tsync_mcore.channel import nodes

from tsync_mcore.publication import send as publish

from tsync_mcore.publication import dist as publish_dist

from tsync_mcore.observability import run_files
from tsync_mcore.observability import trace
from tsync_mcore.channel import (Ack, ChannelError, ChannelTimeout, CloseBatch, DropGroup,
                                 GroupRewards, Hello,
                                 RegisterBatch, Rejected, Shutdown, TrajectoryMsg, TurnMsg,
                                 channel_secret, open_learner_side)
from tsync_mcore.config import Config, to_dict
from tsync_mcore.learner.update import FILTERED, Learner
from tsync_mcore.observability.ledger.account import update_flops
from tsync_mcore.observability.ledger.memory import MemoryMeter
from tsync_mcore.observability.ledger.mfu import detect_peak, mfu_active
from tsync_mcore.observability.ledger.nvml import NvmlSampler
from tsync_mcore.model.parallel import all_gather_json
from tsync_mcore.observability.metrics import local_stats, off_policy_metrics, reduce_stats, throughput
from tsync_mcore.learner.policy import Policy
from tsync_mcore.util.safe_files import BadFile, private_dir
from tsync_mcore.learner.schedule import ASYNC_SCHEDULES
from tsync_mcore.channel.sources import BatchPlan, SourceError
from tsync_mcore.observability.tracking import Tracker, TrackingError


# learner.on_nonfinite: drop_batch still stops once this many batches in a row broke: a
# policy (or data) that keeps producing non-finite gradients would otherwise loop forever.
MAX_DROPPED_IN_A_ROW = 3


class LearnerStopped(RuntimeError):
    """The learner stopped before finishing its updates; the message says why."""


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False):
        self.cfg = cfg
        self.policy = Policy(cfg)
        self.par = self.policy.par
        self.version, self.data_pos = 0, 0
        if nodes.multi_node():  # checkpoints of every node go to rank 0's run.dir
            try:
                checkpoint.check_shared_run_dir(cfg.run.dir, self.par, self.policy.device,
                                                nodes.rank_label(self.par.rank))
            except checkpoint.CheckpointError as e:
                raise LearnerStopped(str(e)) from None
        if resume:
            try:
                ckpt = checkpoint.latest(cfg.run.dir)
                if ckpt is None:
                    raise LearnerStopped(f"--resume: no checkpoint under {cfg.run.dir}/checkpoints")
                meta = checkpoint.load(ckpt, self.policy)
            except checkpoint.CheckpointError as e:
                raise LearnerStopped(f"--resume refused: {e}") from None
            self.version, self.data_pos = meta["version"], meta["data_pos"]
        self._restart_records(ckpt if resume else None)
        self.learner = Learner(cfg.learner, self.policy, self.version)
        self.learner.cost.on = cfg.learner.pack_arrivals  # stream or wait (pass_cost.py)
        self.dropped_in_a_row = 0  # batches skipped for a non-finite gradient, in a row
        # Rank 0's publication ledger: versions published and not yet acknowledged (oldest
        # first), and the version acknowledged last (its file is what a replica reloads).
        self.unacked: list[int] = []
        self.acked: int | None = None
        self.t_ready = 0.0  # the rollout's first acknowledgement: training starts
        self.t_published = 0.0  # the last publication (an async step's period ends there)
        self.finishing = ""  # why the run ends after this update ("": it goes on)
        self.register_wait_s: float | None = None  # the next registration's wait, if longer
        self.publish_dir = publish.resolve_dir(cfg.publish, cfg.run.dir)
        if self.par.rank == 0 and cfg.publish.method == "file":
            try:
                publish.ensure_private_dir(self.publish_dir)
            except publish.PublishDirError as e:
                raise LearnerStopped(str(e)) from None
        if self.par.rank == 0:
            private_dir(cfg.run.dir)
            with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:
                yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        self.tracker = None  # rank 0: metrics.jsonl and the run.loggers backends
        if self.par.rank == 0:
            try:
                self.tracker = Tracker.from_config(cfg, resumed_at=self.version if resume
                                                   else None)
            except TrackingError as e:
                raise LearnerStopped(str(e)) from None
        # Measurement: the peak is measured once on CPU; memory peaks start after set-up.
        self.peak = detect_peak()
        self.memory = MemoryMeter()
        self.memory.reset_after_setup()
        self.nvml = NvmlSampler().start()
        ch = cfg.channel
        self.link = open_learner_side(ch.addr, ch.port, self.par.rank, self.par.world_size,
                                      timeout_s=ch.timeout_s, realtime_io=ch.realtime_io,
                                      secret=channel_secret(cfg),
                                      join_timeout_s=ch.join_timeout_s)
        self.publisher = publish.Publisher(cfg.publish, ch, self.policy,
                                           self.link if self.par.rank == 0 else None,
                                           self.publish_dir, rollout_dtype=cfg.rollout.dtype,
                                           secret=channel_secret(cfg))
        # Manual GC (as Megatron's --manual-gc): Python's automatic full passes walk every
        # object of the model and its imports and hold the GIL meanwhile, mid-stream: the
        # serving thread and the channel reader both stop (docs/measured/learner-process.md has
        # what a pass cost). Set-up's objects
        # are frozen out of collection; a pass runs every run.gc_every updates, while the
        # rollout reloads the published weights.
        self.gc_s = 0.0
        if cfg.run.gc_every:
            gc.collect()
            gc.freeze()
            gc.disable()

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            if self.par.rank == 0:
                self.link.send(Hello(self.version, self.data_pos))
            self._publish()  # replicas start from exactly θ_start
            # the first acknowledgement also waits for the rollout's engine to start
            ch = self.cfg.channel
            start_s = max(ch.ack_timeout_s, ch.timeout_s, ch.join_timeout_s)
            self.t_ready = self.t_published = self._await_acks(start_s)
            # The other ranks' first receive waits out the rollout's start too (rank 0's did
            # in its acknowledgement wait): batch 0's registration follows the engine's start.
            self.register_wait_s = start_s
            self.finishing = "" if self.version < self.cfg.run.updates else "all updates"
            while not self.finishing:
                self._update()
            self._finish_together()
            if self.par.rank == 0 and self.cfg.run.export_hf:
                self._export_hf()
        except (ChannelError, LearnerStopped) as e:
            waiting = self.learner.waiting_for() if isinstance(e, ChannelError) else []
            self._tell_rollout(e)
            raise LearnerStopped(
                f"{nodes.rank_label(self.par.rank)} stopped at policy version {self.version}: {e}"
                + (f"; still waiting for {waiting[:10]}" if waiting else "")
                + f". θ and the last checkpoint are intact ({self._state()}).") from None
        finally:
            if self.tracker is not None:
                self.tracker.finish()
            self.nvml.stop()
            self._write_nvml_timeline()
            self.link.close()

    def _finish_together(self) -> None:
        """Rank 0 takes the last acknowledgements (async: the last publications may still be
        loading) and announces the finish; every rank leaves only after that. The rollout,
        generating ahead under an asynchronous schedule, reads another rank's closed link as
        a failure unless rank 0's Shutdown came first (driver: _learner_finished)."""
        why = ""
        if self.par.rank == 0:
            try:
                self._await_acks(final=True)
                self.link.send(Shutdown(f"learner finished {self.finishing}"))
            except (ChannelError, LearnerStopped) as e:
                why = str(e)
        failed = torch.tensor([float(bool(why))], dtype=torch.float64, device=self.policy.device)
        torch.distributed.broadcast(failed, src=0)
        if failed.item():
            raise LearnerStopped(why or "learner rank 0 did not get the rollout's last "
                                        "acknowledgements")

    def _export_hf(self) -> None:
        """Rank 0: the final checkpoint as a Hugging Face directory, <run.dir>/hf.

        From the checkpoint's files, not the live model: RUN/hf is then exactly what
        `python -m tsync_mcore.learner.export RUN` writes (one path, checked like a resume), it
        needs no collective after the last one (the other ranks may be gone), and it costs
        one read of the TP group's rank files, once per run, after the rollout was told.
        """
        out = os.path.join(self.cfg.run.dir, "hf")
        try:
            done = export.export_checkpoint(self.cfg.run.dir, out, self.version, replace=True)
        except (BadFile, OSError) as e:
            raise LearnerStopped(f"final export to {out} failed: {e}") from None
        print(f"[learner] exported policy version {self.version} to {out} "
              f"({done['seconds']:.1f} s)", flush=True)

    def _state(self) -> str:
        try:
            ckpt = checkpoint.latest(self.cfg.run.dir)
        except checkpoint.CheckpointError as e:
            return str(e)
        return ckpt if ckpt is not None else f"none yet under {self.cfg.run.dir}/checkpoints"

    def _tell_rollout(self, e: Exception) -> None:
        """Say why before the link closes, so the rollout stops with the reason too."""
        try:
            self.link.send(Shutdown(f"learner rank {self.par.rank} stopped: {e}"[:4000]))
        except ChannelError:
            pass

    def _update(self) -> None:
        """One update: registration → sources streamed in and served as they arrive → close
        (reduce, clip, one step) → publish θ_{k+1} → record it while the replicas load θ →
        (synchronous schedules) their acknowledgement."""
        reg, plan, t_start = self._register()
        close = self._stream(plan)
        # The tail counts from the close's arrival (reader thread), not from when this loop
        # got to it: a streaming learner still serving queued sources reads it late, and
        # that serving is tail too.
        t_closed = self.link.last_arrival
        try:
            result = self.learner.close()
        except SourceError as e:
            self.learner.abort()
            raise LearnerStopped(f"batch {self.version} cannot train: {e}") from None
        done = result.summary
        if not done.ok:
            self._skipped(result, reg)
            return
        self.dropped_in_a_row = 0
        t_stepped = time.perf_counter()
        self.version += 1
        self.data_pos = reg.data_pos
        t_publish = time.perf_counter()
        self._publish()
        t_published = time.perf_counter()
        self._record(result, plan, close, t_start=t_start, t_closed=t_closed,
                     t_stepped=t_stepped, t_publish=t_publish, t_published=t_published)

    def _record(self, result, plan: BatchPlan, close: CloseBatch, *,
                t_start: float, t_closed: float, t_stepped: float, t_publish: float,
                t_published: float) -> None:
        """The update's metrics, trace, garbage pass and checkpoint, then (synchronous
        schedules) the wait for θ_{k+1}'s acknowledgement."""
        cfg, done = self.cfg, result.summary
        waits = done.schedule not in ASYNC_SCHEDULES  # for θ_{k+1}'s acknowledgement
        # Recorded while the replicas load θ, so the learner is ready for the next batch
        # once they acknowledge it: recorded after the ack, the next batch's first sources
        # waited for it.
        stale = sum(1 for r in trace.sources(result.trace)
                    if r.policy_version != result.policy_version)
        # F_k: this DP rank's work from its trace (TP ranks of one DP rank share it), summed.
        work = update_flops(self.policy.spec, result.trace, attention=self.policy.attention_mode,
                            lora=self.policy.lora)
        flops = self.policy.dp_sum(work.total)
        recompute = self.policy.dp_sum(work.recompute_flops)
        mem = self.memory.snapshot(host_accum_bytes=done.accum_peak_bytes
                                   if cfg.learner.accum == "host" else None)
        peaks = self._gather_max(mem["peak_mem_bytes"])
        # What open groups held at once, per rank, against the admission bound that applied.
        open_peaks = self._gather_max(done.open_peak_bytes)
        kv_peaks = self._gather_max(done.kv_peak_bytes)
        head_peaks = self._gather_max(done.head_peak_bytes)
        n_stale = int(self.policy.dp_sum(stale))
        n_rejected = int(self.policy.dp_sum(len(done.rejected_sources)))
        stats = self._learner_stats(result.trace, done.dropped_groups)
        self._write_trace(result.trace)
        self._collect_garbage()
        if waits:
            t_end = self._await_acks()
            step_s = t_end - t_start
        else:
            # The steady-state period: publication to publication (the first update: from
            # the learner becoming ready). The rollout's time is hidden in it, not added.
            t_end = t_published
            step_s = t_published - self.t_published
        self.t_published = t_published
        self.finishing = self._finishing()
        if cfg.run.save_every and self.version % cfg.run.save_every == 0 or self.finishing:
            checkpoint.save(cfg.run.dir, self.policy, self.version, self.data_pos)
        metrics = dict(
            step=self.version, policy_version=result.policy_version, ok=True,
            schedule=done.schedule, objective=cfg.learner.objective,
            step_wall_time_s=step_s, rollout_time_s=close.rollout_time_s,
            learner_tail_s=t_stepped - t_closed, publish_time_s=t_end - t_publish,
            gc_s=self.gc_s, reward_mean=close.reward_mean,
            trajectories=sum(len(ts) for ts in plan.groups.values()),
            n_groups=done.n_groups, dropped_groups=done.dropped_groups,
            filtered_groups=sum(r == FILTERED for r in done.dropped_groups.values()),
            scored_tokens=done.scored_tokens, stale_sources=n_stale,
            **off_policy_metrics(done),  # lag and mismatch, already over all DP ranks
            rejected_sources=n_rejected,
            grad_norm=done.grad_norm, lr=done.lr, accum_peak_bytes=done.accum_peak_bytes,
            kv_peak_bytes=max(kv_peaks), kv_peak_bytes_per_rank=kv_peaks,
            head_peak_bytes=max(head_peaks), head_peak_bytes_per_rank=head_peaks,
            open_peak_bytes_per_rank=open_peaks, open_bound=done.open_bound,
            accum_bound_bytes=done.accum_bound_bytes,
            accum_params=done.accum_params, flops=flops, recompute_flops=recompute,
            mfu_active=mfu_active(flops, step_s, self.par.world_size, self.peak),
            peak_tflops=float(self.peak) / 1e12, peak_source=self.peak.source,
            peak_mem_bytes=max(peaks), peak_mem_bytes_per_rank=peaks,
            host_accum_bytes=mem.get("host_accum_bytes"), memory=mem,
            nvml=self.nvml.summary(), **stats,
            tokens_per_s_per_device=throughput(stats["tokens"], step_s, self.par.world_size))
        # The rollout side's own metrics (reward/<extra>, reward/errors, eval/*).
        metrics.update({k: v for k, v in close.metrics.items() if k not in metrics})
        metrics.update(self.publisher.stats)
        if self.par.rank == 0:
            self.tracker.log(metrics, step=self.version)
            print("STEP " + json.dumps(metrics), flush=True)

    def _register(self) -> tuple[RegisterBatch, BatchPlan, float]:
        """The batch's registration, checked and begun; returns it, its plan and when it
        arrived (the step and the trace's clock start there, not when this loop got to it)."""
        cfg = self.cfg
        # rank 0 takes acknowledgements queued before it
        reg = self._recv(RegisterBatch, self.register_wait_s)
        self.register_wait_s = None
        t_start = self.link.last_arrival
        if reg.version != self.version:
            raise LearnerStopped(f"rollout registered a batch for policy version {reg.version}, "
                                 f"the learner is at {self.version}")
        if reg.objective != cfg.learner.objective:
            raise LearnerStopped(f"rollout registered a {reg.objective!r} batch, this learner "
                                 f"trains {cfg.learner.objective!r}: both sides must run the "
                                 f"same config")
        plan = BatchPlan(groups={g: list(ts) for g, ts in reg.groups.items()},
                         n_turns=dict(reg.n_turns))
        try:
            self.learner.begin(plan, schedule=reg.schedule, routing=reg.routing, t0=t_start)
        except (ValueError, SourceError) as e:
            raise LearnerStopped(f"rollout registered batch {reg.version} the learner cannot "
                                 f"train: {e}") from None
        return reg, plan, t_start

    def _stream(self, plan: BatchPlan) -> CloseBatch:
        """Hand the batch's messages to the learner, serving between them, until its
        CloseBatch."""
        if self.policy.ep_size > 1:
            return self._stream_in_lockstep(plan)
        # learner.pack_arrivals: every message already here is handed over before the
        # next pass, so the learner packs what arrived while it was busy
        serve = not self.cfg.learner.pack_arrivals
        self._pass_due, self._handing_since = False, None
        while True:
            msg = self._next_message()
            if msg is None:
                continue  # served one pass
            close = self._take_message(msg, plan, serve)
            if close is not None:
                return close

    def _skipped(self, result, reg: RegisterBatch) -> None:
        """The reduced gradient was not finite and the step did not run: θ_k and the
        optimizer are as they were. Nothing of it is published or checkpointed; the run
        stops, or (learner.on_nonfinite: drop_batch) republishes θ_k and goes on."""
        done = result.summary
        self.policy.take_entropy()  # nothing of this batch is reported
        self._write_trace(result.trace)  # the update record says ok: false, and why
        names = [s for s in done.nonfinite_sources]
        gathered = all_gather_json(names, self.policy.device)  # no pickle across hosts
        culprits = [f"rank {r}: {n[0]}" for r, n in enumerate(gathered) if n]
        why = (f"update {self.version}: the reduced gradient is not finite, so the optimizer "
               f"step was skipped (θ_{self.version} and the optimizer state are untouched; "
               f"nothing of it was published or checkpointed); "
               + (f"first non-finite after {'; '.join(culprits)}" if culprits else
                  f"{done.n_sources} sources served on rank {self.par.rank}; set "
                  f"learner.check_finite=source to name the one that broke the sums"))
        if self.cfg.learner.on_nonfinite == "stop":
            raise LearnerStopped(why)
        self.dropped_in_a_row += 1
        if self.dropped_in_a_row > MAX_DROPPED_IN_A_ROW:
            raise LearnerStopped(f"{why}; {self.dropped_in_a_row} batches in a row were "
                                 f"dropped, so the run stops")
        print(f"[learner rank {self.par.rank}] batch dropped: {why}", file=sys.stderr,
              flush=True)
        self.data_pos = reg.data_pos  # the batch's data was used; θ_k stays
        if self.par.rank == 0:
            # θ_k again, under its own version: the rollout keeps its weights and
            # registers the next batch for version k.
            self.link.send(self.publisher.kept_notice(self.version))
            self.tracker.log(dict(step=self.version, policy_version=self.version, ok=False,
                                  skipped=why), step=self.version)
            self.unacked.append(self.version)
        self._await_acks()

    # --- publication ----------------------------------------------------------------------

    def _publish(self) -> None:
        """Export θ_version and hand it to the rollout (rank 0 sends the notice and, for
        publish.method: dist, broadcasts θ over the publication group)."""
        try:
            self.publisher.publish(self.version)
        except publish_dist.PublishError as e:
            raise LearnerStopped(f"publication of θ_{self.version}: {e}") from None
        if self.par.rank == 0:
            self.unacked.append(self.version)

    def _await_acks(self, timeout_s: float | None = None, final: bool = False) -> float:
        """Rank 0: wait until every published version is acknowledged and return when the
        last acknowledgement arrived (reader thread); other ranks: now. `final`: the run
        has ended, so batch messages the rollout sent meanwhile (it generates ahead under
        the asynchronous schedules, and a budget stop is not announced) are passed over."""
        if self.par.rank != 0:
            return time.perf_counter()
        t = time.perf_counter()
        while self.unacked:
            msg = self.link.recv(timeout_s=timeout_s or self.cfg.channel.ack_timeout_s)
            if isinstance(msg, Ack):
                t = self._take_ack(msg)
            elif isinstance(msg, Shutdown):
                raise LearnerStopped(f"rollout shut down: {msg.reason}")
            elif not (final and isinstance(msg, (RegisterBatch, TrajectoryMsg, TurnMsg,
                                                 GroupRewards, DropGroup, CloseBatch))):
                raise LearnerStopped(f"expected Ack of policy version {self.unacked[0]}, got "
                                     f"{type(msg).__name__}")
        return t

    def _take_ack(self, ack: Ack) -> float:
        """Rank 0: check an acknowledgement against the oldest unacknowledged version; the
        files of older versions go. Returns its arrival time."""
        if self.par.rank != 0 or not self.unacked:
            raise LearnerStopped(f"rollout acknowledged policy version {ack.version}, which "
                                 f"was not published or is acknowledged already")
        want = self.unacked[0]
        if ack.version != want or not ack.ok:
            raise LearnerStopped(f"rollout did not load policy version {want} "
                                 f"(ack for {ack.version}, ok={ack.ok}: {ack.error}); "
                                 f"refusing to train on the old policy")
        self.acked = self.unacked.pop(0)
        drift = self.publisher.check_ack(ack)
        if drift:
            print(f"[learner] {drift}", file=sys.stderr, flush=True)
        if self.cfg.publish.method == "file":
            publish.cleanup(self.publish_dir, keep=[self.acked, *self.unacked])
        return self.link.last_arrival

    def _finishing(self) -> str:
        """Why the run ends after the update just taken ("" if it goes on): run.updates, or
        run.budget_s of training spent (rank 0's clock decides for every rank)."""
        if self.version >= self.cfg.run.updates:
            return "all updates"
        budget = self.cfg.run.budget_s
        if not budget:
            return ""
        over = torch.zeros(1, dtype=torch.float64, device=self.policy.device)
        if self.par.rank == 0:
            over[0] = float(time.perf_counter() - self.t_ready >= budget)
        torch.distributed.broadcast(over, src=0)
        return f"its budget of {budget:g} s after {self.version} updates" if over.item() else ""

    def _collect_garbage(self) -> None:
        """The update's cycles, after publication (the rollout is busy reloading)."""
        every, self.gc_s = self.cfg.run.gc_every, 0.0
        if every and self.version % every == 0:
            t0 = time.perf_counter()
            gc.collect()
            self.gc_s = time.perf_counter() - t0

    def _take_message(self, msg, plan: BatchPlan, serve: bool) -> CloseBatch | None:
        """Hand one message of the open batch to the learner; the CloseBatch that ends the
        batch is returned."""
        if isinstance(msg, Ack):  # async: a replica loaded an earlier publication
            self._take_ack(msg)
        elif isinstance(msg, (TrajectoryMsg, TurnMsg)):
            if self.cfg.run.save_sources and self.par.tp_rank == 0:
                self._save_source(msg.source)
            try:
                self.learner.submit(msg.source, arrived=self.link.last_arrival, serve=serve)
            except SourceError as e:  # never trained on; its group leaves the update
                self._rejected(msg.source, msg.source.group_id, str(e))
        elif isinstance(msg, GroupRewards):
            try:
                if msg.version != self.version:
                    raise SourceError(f"GroupRewards for group {msg.group_id!r} of version "
                                      f"{msg.version} during batch {self.version}")
                self.learner.group_rewards(msg.group_id, msg.rewards, serve=serve)
            except SourceError as e:
                self._rejected(None, msg.group_id, str(e))
        elif isinstance(msg, DropGroup):
            if msg.version == self.version and msg.group_id in plan.groups:
                self.learner.drop_group(msg.group_id, msg.reason)
        elif isinstance(msg, CloseBatch):
            return msg
        elif isinstance(msg, Shutdown):
            raise LearnerStopped(f"rollout shut down during batch {self.version}: {msg.reason}")
        else:
            raise LearnerStopped(f"unexpected {type(msg).__name__} during batch {self.version}")
        return None

    # How long an idle rank waits for a message before it joins the next lockstep round.
    LOCKSTEP_TICK_S = 0.02

    def _stream_in_lockstep(self, plan: BatchPlan) -> CloseBatch:
        """model.ep > 1: every MoE pass is an all-to-all over the EP group, so the ranks
        serve in rounds (`Learner.serve_together`): each hands over what has arrived, then
        every rank joins the round, running its next pass or a dummy one. A rank with
        nothing to do waits a tick for a message between rounds. The batch's sources end
        when every rank has its CloseBatch and no rank has work; a rank that must stop (the
        rollout's shutdown, silence past channel.timeout_s) stops every rank in that round."""
        close, stop = None, None
        quiet_since = time.monotonic()
        while True:
            try:
                while close is None and (msg := self.link.poll()) is not None:
                    quiet_since = time.monotonic()
                    close = self._take_message(msg, plan, serve=False)
            except (ChannelError, LearnerStopped) as e:
                stop = e
            ran, waiting, stopping = self.learner.serve_together(closed=close is not None,
                                                                 stopping=stop is not None)
            if stopping:
                raise stop or LearnerStopped(f"another learner rank stopped during batch "
                                             f"{self.version}")
            if not ran and not waiting:
                return close
            if ran or close is not None:
                continue
            try:
                msg = self.link.recv(timeout_s=self.LOCKSTEP_TICK_S)
            except ChannelTimeout:
                if time.monotonic() - quiet_since > self.cfg.channel.timeout_s:
                    stop = ChannelTimeout(f"nothing arrived from the rollout within "
                                          f"{self.cfg.channel.timeout_s:g} s")
                continue
            quiet_since = time.monotonic()
            try:
                close = self._take_message(msg, plan, serve=False)
            except (ChannelError, LearnerStopped) as e:
                stop = e

    def _next_message(self):
        """The next message of the batch, or None after serving one pass: the messages that
        had arrived when the learner turned to the link are handed over before its next
        pass; one that arrived meanwhile is handed over too, and then a pass runs, so a
        steady stream of arrivals cannot keep the learner from serving."""
        if self._pass_due:
            self._pass_due, self._handing_since = False, None
            if self.learner.serve_next():
                return None
        msg = self.link.poll()
        if msg is not None:
            if self._handing_since is None:
                self._handing_since = time.perf_counter()
            elif self.link.last_arrival > self._handing_since:
                self._pass_due = True
            return msg
        self._handing_since = None
        if self.learner.serve_next():
            return None
        return self.link.recv(timeout_s=self.cfg.channel.timeout_s)

    def _rejected(self, src, group_id: str, reason: str) -> None:
        """A source (or announcement) the learner refused: its group leaves the update here,
        and the rollout is told, so it announces the drop to every rank."""
        print(f"[learner rank {self.par.rank}] rejected: {reason}", file=sys.stderr, flush=True)
        dropped = (self.learner.reject(src, reason) if src is not None
                   else self.learner.reject_rewards(group_id, reason))
        key = getattr(src, "key", f"rewards of {group_id}")
        for g in dropped:
            self.link.send(Rejected(version=self.version, group_id=g, source=str(key),
                                    reason=reason[:2000]))

    def _recv(self, kind: type, timeout_s: float | None = None):
        msg = self.link.recv(timeout_s=timeout_s or self.cfg.channel.timeout_s)
        while isinstance(msg, Ack) and kind is not Ack:  # async: between batches
            self._take_ack(msg)
            msg = self.link.recv(timeout_s=timeout_s or self.cfg.channel.timeout_s)
        if isinstance(msg, Shutdown):
            raise LearnerStopped(f"rollout shut down: {msg.reason}")
        if not isinstance(msg, kind):
            raise LearnerStopped(f"expected {kind.__name__}, got {type(msg).__name__}")
        return msg

    def _learner_stats(self, records: list, dropped) -> dict:
        """Response lengths, tokens and the scored tokens' mean entropy over DP ranks (one
        all-reduce; TP ranks of a DP rank hold the same, so only tp_rank 0 adds its row)."""
        ent_sum, ent_n = self.policy.take_entropy()
        row = local_stats(records, dropped, ent_sum, ent_n)
        t = torch.zeros(self.par.world_size, len(row), dtype=torch.float64,
                        device=self.policy.device)
        if self.par.tp_rank == 0:
            t[self.par.rank] = torch.tensor(row, dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return reduce_stats(t.tolist())

    def _gather_max(self, x: int) -> list[int]:
        """One value per rank (memory is per rank), via a small all-gather."""
        t = torch.zeros(self.par.world_size, dtype=torch.float64, device=self.policy.device)
        t[self.par.rank] = float(x)
        torch.distributed.all_reduce(t)
        return [int(v) for v in t.tolist()]

    def _restart_records(self, ckpt: str | None) -> None:
        """metrics, traces and NVML timelines describe this run only (run_files.py): a
        fresh run replaces an earlier run's, a resume drops records of updates after its
        checkpoint."""
        run_dir, rank = self.cfg.run.dir, self.par.rank
        if ckpt is None:
            removed = run_files.start_fresh(run_dir, rank)
            if removed:
                print(f"[learner rank {rank}] fresh run: replaced {', '.join(removed)} of an "
                      f"earlier run in {run_dir} (--resume keeps them)", file=sys.stderr,
                      flush=True)
        else:
            written = os.path.getmtime(os.path.join(ckpt, "meta.json"))
            dropped = run_files.keep_until(run_dir, rank, self.version, written)
            if dropped:
                print(f"[learner rank {rank}] resume at policy version {self.version}: dropped "
                      f"{dropped} records of updates after the checkpoint from {run_dir}",
                      file=sys.stderr, flush=True)

    def _write_nvml_timeline(self) -> None:
        """Per-GPU samples (perf_counter and wall clock), to align with the release traces."""
        samples = self.nvml.timeline()
        if samples:
            # appended: a resumed run continues the timeline its checkpoint left
            with open(os.path.join(self.cfg.run.dir, f"nvml_rank{self.par.rank}.jsonl"), "a") as f:
                for x in samples:
                    f.write(json.dumps(x) + "\n")

    def _save_source(self, src) -> None:
        """run.save_sources: the trajectory as received, a line of a replay file."""
        path = os.path.join(self.cfg.run.dir, "sources", f"rank{self.par.rank}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"update": self.version, **src.to_json()}) + "\n")

    def _write_trace(self, records: list) -> None:
        path = os.path.join(self.cfg.run.dir, "traces", f"rank{self.par.rank}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        trace.write(path, records)
