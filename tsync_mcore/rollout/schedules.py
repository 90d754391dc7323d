"""The rollout's schedules: when batches are registered, sampled and closed, and when
publications are loaded (docs/design/async.md; the protocol: tsync_mcore.rollout.driver).
Each is a function over a `BatchRunner` (one batch) and an `Evaluator`.

  sync (also group_ready, thundersync): batch k sampled with θ_k, θ_{k+1} loaded and
      acknowledged before batch k+1 starts.
  one_step_off: batch b sampled with θ_{max(b−1, v0)}; publications that arrived are
      loaded between batches.
  fully_async: groups generated continuously, publications loaded mid-request, a batch
      registered once a batch worth of groups completed, stale groups dropped
      (tsync_mcore.rollout.pacing holds the rule)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tsync_mcore.channel import Publish
from tsync_mcore.publication.receive import RolloutStopped
from tsync_mcore.rollout.batch import STOPS, BatchRunner
from tsync_mcore.rollout.evaluation import Evaluator
from tsync_mcore.rollout.pacing import BatchFormer, may_start
from tsync_mcore.rollout.plan import n_turns, plan_batch


def run_schedule(runner: BatchRunner, ev: Evaluator, version: int, data_pos: int) -> None:
    """learner.schedule's loop from update `version` and data position `data_pos` on, until
    the learner finishes (LearnerFinished) or run.updates."""
    schedule = runner.cfg.learner.schedule
    if schedule == "one_step_off":
        return one_step_off(runner, ev, version, data_pos)
    if schedule == "fully_async":
        try:
            return runner.et.run(fully_async(runner, ev, version, data_pos))
        except STOPS as e:  # reward.on_error: fail; a bad row; a failed replica
            raise RolloutStopped(str(e)) from None
    return sync(runner, ev, version, data_pos)


def _run_batch(runner: BatchRunner, ev: Evaluator, version: int, data_pos: int,
               extra: Callable[[], dict] = dict) -> int:
    """Plan, register, run and close batch `version` (`extra()`: more CloseBatch metrics,
    taken once it ran); the data position after it (with dynamic sampling's reserves)."""
    batch = plan_batch(runner.cfg, runner.feed, version, data_pos)
    data_pos += len(batch.groups)
    runner.links.register(version, batch.groups, data_pos,
                          n_turns(runner.cfg, batch, runner.turns))
    t0 = time.perf_counter()
    try:
        out = runner.et.run(runner.run(batch))
    except STOPS as e:  # reward.on_error: fail; a bad row; a failed replica
        raise RolloutStopped(str(e)) from None
    metrics = {**out.metrics, **ev.take_results(), **extra(), **runner.engine_metrics()}
    runner.links.close(version, time.perf_counter() - t0, out.n_sources, out.reward_mean,
                       metrics)
    return data_pos


def sync(runner: BatchRunner, ev: Evaluator, version: int, data_pos: int) -> None:
    """sync / group_ready / thundersync: batch k is sampled with θ_k; the next one starts
    once θ_{k+1} is loaded and acknowledged (θ_k again when the learner dropped batch k)."""
    while version < runner.cfg.run.updates:
        data_pos = _run_batch(runner, ev, version, data_pos)
        live = runner.policy.serve(version + 1, kept=version)
        if live is None:
            return  # the learner finished
        if live == version + 1 and ev.due(live):
            ev.evaluate(live)
        version = live  # == version when the learner dropped the batch


# --- one_step_off -------------------------------------------------------------------------

def one_step_off(runner: BatchRunner, ev: Evaluator, v0: int, data_pos: int) -> None:
    """Batch b sampled with θ_{max(b−1, v0)}: the rollout of batch b+1 runs while the
    learner trains batch b (verl's one-step-off-policy trainer; slime's async mode)."""
    policy = runner.policy
    for b in range(v0, runner.cfg.run.updates):
        catch_up(runner, need=b - 1)
        if policy.swaps and ev.due(policy.loaded):
            ev.evaluate(policy.loaded)
        data_pos = _run_batch(runner, ev, b, data_pos, lambda: async_counters(runner, 0, 0))
    # θ_n, the learner's last publication: evaluated once it is loaded, after the last
    # step's clock stopped (its publication), where a mid-run evaluation would hold the
    # learner's next publication back
    catch_up(runner, need=runner.cfg.run.updates)
    if ev.due(policy.loaded):
        ev.evaluate(policy.loaded)
    catch_up(runner, need=None)  # until the learner says it finished


def catch_up(runner: BatchRunner, need: int | None) -> None:
    """Load (and acknowledge) publications up to θ_need, waiting for them as needed;
    None: every one until the learner says it finished (raises LearnerFinished). A
    later one that has arrived already waits in the links' notices for the next batch: a
    streaming learner often publishes θ_b before batch b starts, and loading it would
    make batch b on-policy, not one step off."""
    links, policy = runner.links, runner.policy
    link = links.links[0]
    while need is None or policy.loaded < need:
        msg = (links.notices.pop(0) if links.notices
               else link.recv(timeout_s=runner.cfg.channel.timeout_s))
        if not isinstance(msg, Publish):
            links.on_message(msg, -1)
            continue
        policy.check(msg)
        runner.et.run(policy.reload(msg))


def async_counters(runner: BatchRunner, dropped: int, partial: int) -> dict[str, float]:
    """async/*: stale groups dropped and partial sources of this batch, reloads since the
    last batch."""
    return {"async/dropped_stale_groups": dropped, "async/partial_sources": partial,
            "async/weight_swaps": runner.policy.take_swaps()}


# --- fully_async --------------------------------------------------------------------------

async def fully_async(runner: BatchRunner, ev: Evaluator, v0: int, data_pos: int) -> None:
    """Generate continuously; register batch k once a batch worth of groups completed."""
    rc, policy = runner.rc, runner.policy
    cap = rc.max_groups_in_flight or rc.groups_per_batch
    s, per_batch = runner.cfg.learner.max_staleness, rc.groups_per_batch
    former = BatchFormer(per_batch, s)
    running: dict[asyncio.Task, int] = {}  # group task → its data position
    pos, live, k = data_pos, 0, v0  # next data position; groups started, not dropped
    next_data_pos = data_pos  # RegisterBatch.data_pos: past every group used or dropped
    dropped, t0 = 0, time.perf_counter()
    try:
        while k < runner.cfg.run.updates:
            await take_notices(runner)
            while len(running) < cap and may_start(live, policy.loaded, v0, s, per_batch):
                running[asyncio.ensure_future(runner.run_group(pos))] = pos
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
                rollout_s = time.perf_counter() - t0
                out = runner.send_groups(k, groups, next_data_pos)
                partial = out.metrics["async/partial_sources"]
                metrics = {**async_counters(runner, dropped, partial), **ev.take_results(),
                           **runner.engine_metrics()}
                runner.links.close(k, rollout_s, out.n_sources, out.reward_mean, metrics)
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
        await take_notices(runner)
        await asyncio.sleep(0.005)


async def take_notices(runner: BatchRunner) -> None:
    """Every message the learners sent: a Publish is loaded at once, mid-request (abort
    and continue, so versions stay exact per token), and acknowledged."""
    links, policy = runner.links, runner.policy
    for link in links.links:
        while (msg := link.poll()) is not None:
            links.on_message(msg, -1)  # Publish → links.notices
    while links.notices:
        msg = policy.check(links.notices.pop(0))
        await policy.reload(msg, mode="abort")
