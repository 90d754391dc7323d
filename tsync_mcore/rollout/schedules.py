"""The rollout's schedules: when batches are registered, sampled and closed, and when
publications are loaded (docs/design/async.md; the protocol: tsync_mcore.rollout.driver).

  sync (also group_ready, thundersync): batch k sampled with θ_k, θ_{k+1} loaded and
      acknowledged before batch k+1 starts.
  one_step_off: batch b sampled with θ_{max(b−1, v0)}; publications that arrived are
      loaded between batches.
  fully_async: groups generated continuously, publications loaded mid-request, a batch
      registered once a batch worth of groups completed, stale groups dropped
      (tsync_mcore.rollout.pacing holds the rule).

`Schedules` is a part of RolloutDriver; the one-batch work is tsync_mcore.rollout.batch."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from tsync_mcore.channel import CloseBatch, Publish
from tsync_mcore.channel.routing import BalancedRouter
from tsync_mcore.channel.sources import SourceError, validate_source
from tsync_mcore.publication.receive import RolloutStopped
from tsync_mcore.rollout.batch import STOPS, _Batch
from tsync_mcore.rollout.loop import run_batch
from tsync_mcore.rollout.pacing import BatchFormer, Group, may_start


class Schedules:
    """RolloutDriver's schedule loops; they use the driver's state and its one-batch work."""

    def _sync(self, version: int, data_pos: int) -> None:
        """sync / group_ready / thundersync: batch k is sampled with θ_k; the next one starts
        once θ_{k+1} is loaded and acknowledged (θ_k again when the learner dropped batch k)."""
        while version < self.cfg.run.updates:
            batch = self._plan(version, data_pos)
            data_pos += len(batch.groups)  # with dynamic sampling's reserves
            self._register(version, batch.groups, data_pos, self._n_turns(batch))
            t0 = time.perf_counter()
            try:
                n_sources, reward_mean, metrics = self.et.run(self._rollout(batch))
            except STOPS as e:  # reward.on_error: fail; a bad row; a failed replica
                raise RolloutStopped(str(e)) from None
            metrics = {**metrics, **self.pending_metrics, **self._engine_metrics()}
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

    # --- one_step_off ---------------------------------------------------------------------

    def _one_step_off(self, v0: int, data_pos: int) -> None:
        """Batch b sampled with θ_{max(b−1, v0)}: the rollout of batch b+1 runs while the
        learner trains batch b (verl's one-step-off-policy trainer; slime's async mode)."""
        for b in range(v0, self.cfg.run.updates):
            self._catch_up(need=b - 1)
            if self.swaps and self._eval_due(self.loaded):
                self._evaluate(self.loaded)
            batch = self._plan(b, data_pos)
            data_pos += len(batch.groups)  # with dynamic sampling's reserves
            self._register(b, batch.groups, data_pos, self._n_turns(batch))
            t0 = time.perf_counter()
            try:
                n_sources, reward_mean, metrics = self.et.run(self._rollout(batch))
            except STOPS as e:
                raise RolloutStopped(str(e)) from None
            metrics = {**metrics, **self.pending_metrics, **self._async_counters(0, 0),
                       **self._engine_metrics()}
            self.pending_metrics = {}
            close = CloseBatch(version=b, rollout_time_s=time.perf_counter() - t0,
                               n_sources=n_sources, reward_mean=reward_mean, metrics=metrics)
            for link in self.links:
                link.send(close)
        # θ_n, the learner's last publication: evaluated once it is loaded, after the last
        # step's clock stopped (its publication), where a mid-run evaluation would hold the
        # learner's next publication back
        self._catch_up(need=self.cfg.run.updates)
        if self._eval_due(self.loaded):
            self._evaluate(self.loaded)
        self._catch_up(need=None)  # until the learner says it finished

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
                      step_timeout_s=self._step_timeout_s(), **self._render_kwargs())
        members, stats = [], self.feed.stats() if self.feed is not None else None
        async for i, res in run_batch(self.engine, envs, seeds=seeds, env_seeds=[pos] * m,
                                      routes=[gid] * m, **kwargs):
            if stats is not None:
                stats.add(envs[i])
            res.reward = self._shaped(res)  # reward.overlong_buffer
            segs = self._trajectory(tids[i], gid, res, 0)
            try:
                for src in segs:
                    validate_source(src, self.vocab_size, self.max_tokens)
            except SourceError as e:
                print(f"[rollout] dropped group {gid}: {e}", flush=True)
                return None
            members.extend(segs)
        return Group(gid, pos, members, min(x.policy_version for x in members))

    def _send_batch(self, k: int, groups: list[Group], data_pos: int, dropped: int,
                    rollout_s: float) -> None:
        """Register batch k with these completed groups, send their sources, close it."""
        self.dropped = {}
        self._take_rejections(k)
        plan = {g.group_id: list(dict.fromkeys(x.traj_id for x in g.members)) for g in groups}
        self._register(k, plan, data_pos, {})
        batch = _Batch(k, plan, [], [], [], [])
        owners = self._owners(batch)
        router = BalancedRouter(plan, self.rc.n_learners // self.tp)
        order, partial, rewards = 0, 0, []
        for g in groups:
            trajs: dict[str, list] = {}  # a trajectory's segments travel together
            for src in g.members:
                trajs.setdefault(src.traj_id, []).append(src)
            for segs in trajs.values():
                self._take_rejections(k)
                if g.group_id in self.dropped:
                    break
                segs = [dataclasses.replace(s, ready_order=order + j) for j, s in enumerate(segs)]
                order += len(segs)
                partial += any(bool(s.token_versions) for s in segs)
                rewards.append(segs[0].reward)
                self._send_trajectory(k, segs, owners, router)
        self._take_rejections(k)
        ok = [r for r in rewards if math.isfinite(r)]
        metrics = {**self._async_counters(dropped, partial), **self.pending_metrics,
                   **self._engine_metrics()}
        self.pending_metrics = {}
        close = CloseBatch(version=k, rollout_time_s=rollout_s, n_sources=order,
                           reward_mean=sum(ok) / len(ok) if ok else None, metrics=metrics)
        for link in self.links:
            link.send(close)
