"""The simulated rollout's side of the channel: register a batch, release its sources at their
model times (routed as the real rollout routes them), close it; the asynchronous schedules'
segments under their live protocol (docs/design/async.md), decisions in async_rollout.py."""

from __future__ import annotations

import time
from dataclasses import replace
from statistics import mean

from tsync_mcore.channel import (Ack, ChannelTimeout, CloseBatch, GroupRewards, Publish,
                                 RegisterBatch, TrajectoryMsg, TurnMsg)
from tsync_mcore.channel.routing import BalancedRouter
from tsync_mcore.channel.sources import BatchPlan, assign_groups

from perf.bench.async_rollout import FullyAsyncStream, one_step_off_sampler
from perf.bench.plan import Step
from perf.bench.workload import RecordedWorkload, Workload


def play(links, work: Workload | RecordedWorkload, v: int, step: Step, R: float,
         routing: str = "balanced", sampled: int | None = None) -> tuple[list[float], list]:
    """One batch: register, release sources at their completion times, close at R.

    `sampled`: the policy version the sources carry (default v: on-policy).
    Returns each release's lag (its send's completion after its model time) and each
    source's (policy lag, scored tokens) as sent."""
    plan, n_turns, items = work.update(v, R, draw=step.draw)
    if sampled is not None:
        items = [(ready, replace(src, policy_version=sampled)) for ready, src in items]
    lag = send_batch(links, work.objective, v, plan, n_turns, items, step.schedule, R, routing)
    return lag, sent_lag(v, items)


def sent_lag(v: int, items: list) -> list[tuple[int, int]]:
    return [(v - src.policy_version, src.n_scored) for _, src in items]


def send_batch(links, objective: str, v: int, plan: BatchPlan, n_turns: dict, items: list,
               schedule: str, R: float, routing: str, rollout_s: float | None = None,
               metrics: dict | None = None) -> list[float]:
    """Register batch v, send its sources at their ready times (seconds after the
    registration) and close it at R (rollout_time_s: `rollout_s`, default the time taken).

    Routing as the real rollout does it (tsync_mcore.channel.routing): "balanced" sends each GRPO
    trajectory to the rank with the least tokens assigned so far and announces a split
    group's rewards to the ranks holding its members after its last one; "static" (and OPD)
    sends by group owner. Returns each release's lag: its send's completion after its
    model time."""
    grpo = objective == "grpo"
    routing = routing if grpo else "static"
    owner = assign_groups(plan, {}, 2)
    router = BalancedRouter(plan.groups, 2)
    msgs = []  # (ready, [(rank, message)])
    for ready, src in items:
        if not grpo:
            msgs.append((ready, [(owner[src.group_id], TurnMsg(src))]))
            continue
        if routing == "static":
            msgs.append((ready, [(owner[src.group_id], TrajectoryMsg(src))]))
            continue
        to = router.route(src.traj_id, src.group_id, src.reward, len(src.tokens))
        out = [(to.rank, TrajectoryMsg(src))]
        if to.rewards is not None:
            announce = GroupRewards(version=v, group_id=src.group_id, rewards=to.rewards)
            out += [(r, announce) for r in to.announce_to]
        msgs.append((ready, out))
    # Encoded now, while the learners wait for the registration: at release time a send is
    # the gloo op alone, so the simulated rollout takes less of the learners' cores.
    msgs = [(ready, [(rank, links[rank].prepare(msg)) for rank, msg in out])
            for ready, out in msgs]
    for link in links:
        link.send(RegisterBatch(version=v, objective=objective, groups=plan.groups,
                                n_turns=n_turns, data_pos=v + 1, schedule=schedule,
                                routing=routing))
    t0 = time.perf_counter()
    lag = []
    for ready, out in msgs:
        delay = t0 + ready - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for rank, msg in out:
            links[rank].send(msg)
        lag.append(time.perf_counter() - t0 - ready)
    if rollout_s is None:
        rollout_s = max(R, time.perf_counter() - t0)
    time.sleep(max(0.0, t0 + R - time.perf_counter()))
    for link in links:
        link.send(CloseBatch(version=v, rollout_time_s=rollout_s, n_sources=len(items),
                             metrics=metrics or {}))
    return lag


def reload(link, loaded: int, need: int) -> int:
    """Acknowledge every publication that has arrived (the simulated rollout reloads in no
    time), waiting while the loaded version is below `need`; return the loaded version."""
    while True:
        msg = link.poll() if loaded >= need else link.recv(timeout_s=300)
        if msg is None:
            return loaded
        assert isinstance(msg, Publish) and msg.version == loaded + 1, (msg, loaded)
        link.send(Ack(version=msg.version, ok=True))
        loaded = msg.version


def play_one_step_off(links, work, v0: int, seg: list[Step], R: float,
                      routing: str) -> list[dict]:
    """A one_step_off segment of updates v0 … v0+n−1 (docs/design/async.md): batch b is sampled
    with θ_{max(b−1, v0)}; its rollout starts when batch b−1 closes, waiting only until
    that version is published. The learner gets batch b's registration and sources while
    it still trains batch b−1. Afterwards every publication is acknowledged, so the next
    (synchronous) batch starts from the learner's latest θ."""
    loaded, out = v0, []
    for i, step in enumerate(seg):
        b = v0 + i
        need = one_step_off_sampler(b, v0)
        loaded = reload(links[0], loaded, need)
        cpu0 = time.process_time()
        lag, sent = play(links, work, b, step, R, routing, sampled=need)
        out.append(dict(R_s=R, sim_cpu_s=time.process_time() - cpu0, release_lag_s=lag,
                        sent_lag=sent, dropped_stale_groups=0))
    reload(links[0], loaded, v0 + len(seg))
    return out


def play_fully_async(links, work, v0: int, seg: list[Step], R: float, routing: str,
                     max_staleness: int) -> list[dict]:
    """A fully_async segment of updates v0 … v0+n−1 (docs/design/async.md): the draw's groups are
    generated as a continuous stream (group i of the stream is the draw's group i mod G,
    taking as long as its slowest member, u·R), a batch worth in flight, AReaL's staleness
    bound on starts (async_rollout.FullyAsyncStream); publications are loaded (and
    acknowledged) as they arrive. Each batch is the next G completed groups, registered,
    sent at once and closed; rollout_time_s is the time since the previous registration."""
    plan, n_turns, items = work.update(v0, R, draw=seg[0].draw)
    gids = list(plan.groups)
    members: dict[str, list] = {g: [] for g in gids}
    for ready, src in items:
        members[src.group_id].append((ready, src))
    G = len(gids)
    dur = [max(r for r, _ in members[g]) for g in gids]
    stream = FullyAsyncStream(G, max_staleness, v0, duration=lambda i: dur[i % G])
    link, out = links[0], []
    t0 = last = time.perf_counter()
    cpu0 = time.process_time()
    while len(out) < len(seg):
        now = time.perf_counter() - t0
        stream.complete_until(now)
        dropped = stream.dropped_stale
        batch = stream.take_batch()
        if batch is not None:
            k = v0 + len(out)
            bplan, bturns, bitems = stream_batch(k, batch, gids, members, n_turns)
            t_reg = time.perf_counter()
            metrics = {"async/dropped_stale_groups": float(stream.dropped_stale - dropped)}
            lag = send_batch(links, work.objective, k, bplan, bturns, bitems,
                             "fully_async", 0.0, routing, rollout_s=t_reg - last,
                             metrics=metrics)
            out.append(dict(R_s=t_reg - last, sim_cpu_s=0.0, release_lag_s=lag,
                            sent_lag=sent_lag(k, bitems),
                            dropped_stale_groups=stream.dropped_stale - dropped,
                            # G slots, each a group at a time: a batch per mean duration
                            R_stream_s=mean(dur)))
            last = t_reg
            continue
        stream.start_groups(now)
        nxt = stream.next_completion()
        try:
            msg = link.recv(timeout_s=300 if nxt is None else max(0.0, nxt - now))
        except ChannelTimeout:
            continue  # a group completed
        assert isinstance(msg, Publish) and msg.version == stream.loaded + 1, (msg, stream.loaded)
        link.send(Ack(version=msg.version, ok=True))
        stream.load(msg.version)
    cpu = (time.process_time() - cpu0) / len(out)
    for o in out:
        o["sim_cpu_s"] = cpu
    reload(link, stream.loaded, v0 + len(seg))
    return out


def stream_batch(k: int, batch: list, gids: list[str], members: dict, n_turns: dict):
    """Batch k from the stream's groups: each one the draw's group (index mod G) under an id
    of this batch and stream place, its sources carrying the version that sampled them,
    ready at once (the group completed before the registration)."""
    plan, turns, items = BatchPlan(), {}, []
    for sg in batch:
        old = gids[sg.index % len(gids)]
        # "v<k>s<i>-g<j>": the part after the first "-" names the draw's group, as in sync
        new = f"v{k}s{sg.index}-{old.split('-', 1)[1]}"
        trajs = []
        for _, src in members[old]:
            tid = new + src.traj_id[len(old):]
            if tid not in trajs:
                trajs.append(tid)
            if src.traj_id in n_turns:
                turns[tid] = n_turns[src.traj_id]
            items.append((0.0, replace(src, traj_id=tid, group_id=new,
                                       policy_version=sg.version)))
        plan.add_group(new, trajs)
    return plan, turns, items


def ack(link, version: int) -> None:
    msg = link.recv(timeout_s=300)
    assert isinstance(msg, Publish) and msg.version == version, msg
    link.send(Ack(version=version, ok=True))
