"""perf/bench/check.py (regression guard), perf/bench/kernels.py (smoke on tiny shapes), perf/gpu.sh (no GPU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from perf.bench import check, kernels
from tests.helpers.perf_shared import result_doc


def test_overlap_flags_cells_run_on_a_busy_host():
    from perf.bench.analysis import mark_busy_host

    def c(schedule, ratio, wall_over_cpu):
        return {"schedule": schedule, "ratio": ratio, "wall_over_cpu": wall_over_cpu}

    # the 21:29 sweep's pattern: one streaming cell far above its schedule's others
    cells = [c("sync", r, 1.025) for r in (0.5, 1, 2)] + [c("sync", 4, 1.041)]
    cells += [c("thundersync", r, w) for r, w in ((0.5, 1.046), (1, 1.105), (2, 1.035))]
    cells += [c("group_ready", r, w) for r, w in ((0.5, 1.044), (1, 1.059), (2, 1.034))]
    busy = mark_busy_host(cells)
    assert [(b["schedule"], b["ratio"]) for b in busy] == [("thundersync", 1)]
    assert [x["host_busy"] for x in cells].count(True) == 1
    assert mark_busy_host([c("sync", 1, 1.3)]) == []  # one cell: nothing to compare with


def test_compare_improvement_is_not_a_regression():
    result = copy.deepcopy(result_doc())
    result["kernels"][2]["time_s"] = 0.5
    result["overlap"][0]["speedup_measured"] = 2.5
    rows = check.compare(result, result_doc(), 0.15)
    assert {r["status"] for r in rows} == {"ok"}


def test_kernels_smoke_fields_and_equal_work():
    recs = kernels.run_benchmarks("cpu", quick=True, logprob_shapes=[(16, 300)], accum_numel=4096,
                                  stream_numel=4096, reps=1, lm_head_shape=(40, 8, 300),
                                  lm_head_chunk=16)  # fmt: skip
    timed = [r for r in recs if r["time_s"] is not None]
    for r in recs:
        assert {"name", "impl", "shape", "time_s", "peak_mem_bytes", "bytes_per_s"} <= r.keys()
    names = {(r["name"], r["impl"]) for r in timed}
    for name in ("scored_logprob_fwd", "scored_logprob_fwd_bwd", "accumulate_g1g2", "combine_group", "axpy"):
        assert {(name, "plain"), (name, "fused-torch")} <= names
    assert {("stream_bandwidth", "copy_"), ("stream_bandwidth", "add_")} <= names
    assert {("lm_head_fwd_bwd", i) for i in ("plain", "unfused-torch", "fused-torch")} <= names
    for r in timed:
        assert r["time_s"] > 0 and r["peak_mem_bytes"] >= 0 and r["peak_mem_source"] == "analytic"
        if r["name"].startswith("scored_logprob") or r["name"] == "lm_head_fwd_bwd" \
                and r["impl"] != "plain":
            assert r["max_abs_err"] <= 1e-5 and r["grad_max_abs_err"] <= 1e-5, r
        if r["name"] in ("accumulate_g1g2", "combine_group", "axpy"):
            assert 0 < r["bw_fraction"] and r["vs_plain"] > 0
    liger = [r for r in recs if r["impl"] == "liger"]
    assert len(liger) == 1 and liger[0]["time_s"] is None and "unavailable" in liger[0]["skipped"]


def test_kernels_fused_equals_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(32, 1000, generator=gen)
    targets = torch.randint(0, 1000, (32,), generator=gen)
    import tsync_mcore.kernels as K

    with kernels._backend("torch"):
        fused = K.scored_logprob(logits, targets)
    torch.testing.assert_close(fused, kernels.plain_logprob(logits, targets), atol=1e-5, rtol=0)


def test_kernels_quick_cli_skips_large_shapes(tmp_path, monkeypatch):
    shrunk = {**kernels.ACCUM_NUMEL, "cpu-quick": 4096}
    monkeypatch.setattr(kernels, "ACCUM_NUMEL", shrunk)
    monkeypatch.setattr(kernels, "STREAM_NUMEL", {**kernels.STREAM_NUMEL, "cpu-quick": 4096})
    monkeypatch.setattr(kernels, "LOGPROB_SHAPES", [(8, 100), (4096, 4096)])
    monkeypatch.setattr(kernels, "MIN_ACCUM_REPS", 1)
    monkeypatch.setattr(kernels, "LM_HEAD_SHAPES", {"cpu-quick": (40, 8, 300)})
    out = tmp_path / "k.json"
    assert kernels.main(["--quick", "--device", "cpu", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "date", "overlap", "kernels"} <= doc.keys()
    skipped = [r for r in doc["kernels"] if r.get("skipped") and r["name"].startswith("scored")]
    assert {r["shape"]["T"] for r in skipped} == {4096} and all("quick" in r["skipped"] for r in skipped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_step_exits_zero_without_gpu(capsys, tmp_path):
    from perf.bench import gpu_step

    assert gpu_step.main(["--json", str(tmp_path / "x.json")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()


def test_overlap_workload_is_valid_and_follows_the_release_model():
    # The simulator's sources must pass the learner's own validation, arrive within R,
    # and grow with completion time (service ∝ U^γ).
    from perf.bench.workload import Workload

    from tsync_mcore.channel.sources import (  # noqa: F401
        opd_turns_from_json,
        validate_source,
        validate_turn,
    )

    for objective in ("grpo", "opd"):
        w = Workload(objective=objective, batch=16)
        plan, n_turns, items = w.update(0, R=2.0)
        assert plan.n_groups == 4 and all(0 <= t <= 2.0 for t, _ in items)
        assert [t for t, _ in items] == sorted(t for t, _ in items)
        for _, src in items:
            (validate_source if objective == "grpo" else validate_turn)(src, w.vocab)
        if objective == "grpo":
            pts = sorted((t, src.n_tokens) for t, src in items)
            assert pts[-1][1] > pts[0][1]
        else:
            by_traj = {}
            for _, src in items:
                by_traj.setdefault(src.traj_id, []).append(src)
            for turns in by_traj.values():
                turns.sort(key=lambda s: s.turn)
                assert [s.turn for s in turns] == list(range(w.turns))
                assert all(a.end == b.start for a, b in zip(turns, turns[1:]))


def test_overlap_plan_pairs_schedules_per_draw():
    # Each round: a calibration update of its draw (R = 0), then the three synchronous
    # schedules on the same draw, the order rotated so no schedule always runs first after
    # calibration.
    from perf.bench.plan import plan_steps

    schedules = ("sync", "group_ready", "thundersync")
    steps = plan_steps(rounds=3, warmup=2, schedules=schedules)
    warm, steps = steps[:8], steps[8:]  # a warm-up round plays every schedule once, unmeasured
    for d, (calib, *played) in zip((-1, -2), (warm[:4], warm[4:])):
        assert calib.calibration and calib.draw == d
        assert [s.schedule for s in played] == list(schedules)
        assert all(s.warmup and s.draw == d and not s.calibration for s in played)
    assert not any(s.warmup for s in steps)
    rounds = [steps[4 * i: 4 + 4 * i] for i in range(3)]
    assert len(steps) == 4 * 3
    firsts = set()
    for d, (calib, *timed) in enumerate(rounds):
        assert calib.calibration and calib.schedule == "sync" and calib.draw == d
        assert sorted(s.schedule for s in timed) == sorted(schedules)
        assert all(s.draw == d and not s.calibration for s in timed)
        firsts.add(timed[0].schedule)
    assert firsts == set(schedules)


def test_overlap_plan_plays_asynchronous_segments_of_the_round_draw():
    # An asynchronous schedule plays a segment of consecutive updates on the round's draw,
    # the first ones (pipeline fill) unmeasured; every schedule leads one round in five.
    from perf.bench.plan import SCHEDULES, plan_steps, segment_at

    steps = plan_steps(rounds=5, warmup=1, segment=4, steady_from=2)
    per_round = 1 + 3 + 2 * 4
    assert len(steps) == 6 * per_round
    firsts = set()
    for r in range(1, 6):
        calib, *timed = steps[r * per_round:(r + 1) * per_round]
        assert calib.calibration and all(s.draw == r - 1 for s in timed)
        firsts.add(timed[0].schedule)
        for name in ("one_step_off", "fully_async"):
            seg = [s for s in timed if s.schedule == name]
            assert [s.seg for s in seg] == [0, 1, 2, 3]
            assert [s.steady for s in seg] == [False, False, True, True]
            start = steps.index(seg[0])
            assert segment_at(steps, start) == seg  # consecutive
    assert firsts == set(SCHEDULES)
    with pytest.raises(ValueError, match="sync"):
        plan_steps(1, schedules=("thundersync", "one_step_off"))


def test_one_step_off_samples_each_batch_with_the_previous_version():
    from perf.bench.async_rollout import one_step_off_sampler

    assert [one_step_off_sampler(b, 5) for b in range(5, 9)] == [5, 5, 6, 7]


def _drive_fully_async(G: int, staleness: int, L: float, durations: list[float], batches: int):
    """The stream against a learner taking L per batch (fake clock): it trains batch k once
    registered and θ_k published, and publishes θ_{k+1} L later. Returns (stream, log of
    registrations (time, k, group versions), max groups started before each load)."""
    from perf.bench.async_rollout import FullyAsyncStream

    s = FullyAsyncStream(G, staleness, v0=3, duration=lambda i: durations[i % len(durations)])
    now, publish_at, log, free = 0.0, [], [], 0.0
    starts_ok = []
    while len(log) < batches:
        s.complete_until(now)
        while (b := s.take_batch()) is not None:
            k = s.next_batch - 1
            log.append((now, k, [g.version for g in b]))
            free = max(free, now) + L  # the learner trains batches in order
            publish_at.append((free, k + 1))
        s.start_groups(now)
        starts_ok.append(s.started <= (s.loaded - 3 + staleness + 1) * G)
        events = [t for t, _ in publish_at] + ([s.next_completion()]
                                               if s.next_completion() is not None else [])
        now = min(events)
        for t, v in sorted(publish_at):
            if t <= now:
                s.load(v)
        publish_at = [(t, v) for t, v in publish_at if t > now]
    return s, log, starts_ok


def test_fully_async_stream_bounds_policy_lag_and_counts_drops():
    import random

    rng = random.Random(0)
    durations = [rng.uniform(0.1, 1.0) for _ in range(8)]
    for staleness, L in ((1, 0.3), (1, 2.0), (2, 2.0)):
        s, log, starts_ok = _drive_fully_async(8, staleness, L, durations, batches=12)
        assert all(starts_ok)
        assert [k for _, k, _ in log] == list(range(3, 15))
        for _, k, versions in log:
            assert len(versions) == 8 and all(0 <= k - v <= staleness for v in versions)
        if L > 1.0:  # learner-bound: the bound holds the rollout back, lag reaches it
            assert max(k - v for _, k, vs in log for v in vs) == staleness
    # A slow straggler (group 0 takes 10× the others) falls behind the bound: dropped.
    s, log, _ = _drive_fully_async(4, 1, 0.2, [5.0, 0.5, 0.5, 0.5], batches=6)
    assert s.dropped_stale >= 1
    assert all(k - v <= 1 for _, k, vs in log for v in vs)


def test_fully_async_batches_reuse_the_draw_groups_under_fresh_ids():
    from perf.bench.async_rollout import StreamGroup
    from perf.bench.simulator import stream_batch
    from perf.bench.workload import Workload

    from tsync_mcore.channel.sources import validate_source

    w = Workload(objective="grpo", batch=16)
    plan, n_turns, items = w.update(7, R=1.0, draw=0)
    gids = list(plan.groups)
    members = {g: [(t, src) for t, src in items if src.group_id == g] for g in gids}
    batch = [StreamGroup(5, 6, 0.0, 1.0), StreamGroup(1, 7, 0.0, 1.0),
             StreamGroup(9, 7, 0.0, 1.0), StreamGroup(4, 6, 0.0, 1.0)]
    bplan, _, bitems = stream_batch(7, batch, gids, members, n_turns)
    assert len(bplan.groups) == 4 and len(bitems) == 16
    # stream groups 1 and 9 are both the draw's group 1: same tokens, distinct ids
    assert list(bplan.groups) == ["v7s5-g1", "v7s1-g1", "v7s9-g1", "v7s4-g0"]
    for _, src in bitems:
        validate_source(src, w.vocab)
        assert src.traj_id in bplan.groups[src.group_id]
        assert src.policy_version == {"v7s5": 6, "v7s1": 7, "v7s9": 7, "v7s4": 6}[
            src.group_id.split("-")[0]]
        # the pairing key (id without the batch part) names the draw's same trajectory
        twin = {s.traj_id.split("-", 1)[1]: s for _, s in items}[src.traj_id.split("-", 1)[1]]
        assert twin.tokens == src.tokens


def test_recorded_opd_release_trace_replays_turns_and_shared_prompts(tmp_path):
    # A hand-written OPD trace (2 groups x 2 trajectories x 2 turns, shared 8-token prompts):
    # turns replay contiguous, at their recorded fraction of R, with the group's prompt.
    import json

    from perf.bench.workload import RecordedWorkload

    from tests.helpers.records import deferred, source
    from tsync_mcore.channel.sources import validate_turn
    from tsync_mcore.observability import trace

    (tmp_path / "traces").mkdir()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"policy_version": 0, "rollout_time_s": 4.0}) + "\n")
    entries = []
    for g in range(2):
        for t in range(2):
            tid = f"v0-g{g}-t{t}"
            # turn 1 logged first (it arrived early): the prompt comes from turn 0's entry
            entries += [source(update=0, traj_id=tid, turn=1, group_id=f"v0-g{g}", rank=g,
                               ready=2.0 + t, scored_tokens=3, span_tokens=6, context=17),
                        source(update=0, traj_id=tid, turn=0, group_id=f"v0-g{g}", rank=g,
                               ready=1.0 + t, scored_tokens=5, span_tokens=10, context=7),
                        deferred(update=0, work="replay", traj_id=tid, group_id=f"v0-g{g}",
                                 rank=g, ready=3.0, start=3.0, end=3.1, spans=[(10, 7)])]
    for r in (0, 1):
        trace.write(str(tmp_path / "traces" / f"rank{r}.jsonl"),
                    [e for e in entries if e.rank == r])
    w = RecordedWorkload.from_run(str(tmp_path), vocab=64)
    assert (w.objective, w.batch) == ("opd", 4)
    plan, n_turns, items = w.update(3, R=2.0)
    assert plan.n_groups == 2 and n_turns == {f"v3-g{g}-t{t}": 2 for g in range(2) for t in range(2)}
    turns = {(s.traj_id, s.turn): (ready, s) for ready, s in items}
    for (tid, j), (ready, s) in turns.items():
        validate_turn(s, 64)
        assert ready == 2.0 * ((1.0 if j == 0 else 2.0) + int(tid[-1])) / 4.0
        assert (len(s.tokens), s.n_scored) == ((17, 5) if j == 0 else (6, 3))
        assert s.prompt_len == 8
    for g in range(2):  # members share the group's prompt tokens (the learner's shared prefix)
        a, b = turns[(f"v3-g{g}-t0", 0)][1], turns[(f"v3-g{g}-t1", 0)][1]
        assert a.tokens[:8] == b.tokens[:8]
    assert turns[("v3-g0-t0", 1)][1].start == 17
    with pytest.raises(ValueError, match="token_scale"):
        RecordedWorkload("opd", w.recorded, token_scale=0)


def test_sweep_clock_skips_idle_waits_only():
    from perf.bench import gpu_sweep

    drained = []
    clock = gpu_sweep.SimClock(lambda: drained.append(True))
    t0 = clock.now()
    clock.wait_until(t0 + 100.0)  # nothing ready for 100 s: the device drains, the clock jumps
    assert drained and clock.now() - t0 >= 100.0 and clock.skipped <= 100.0
    before = len(drained)
    clock.wait_until(t0)  # already past: no sync, no skip
    assert len(drained) == before and clock.skipped <= 100.0


def test_gpu_step_sweep_dry_run_on_cpu(parallel1, tmp_path):
    """The sweep's code path on the tiny model (`--device cpu --model tiny`): the project's
    Learner under sync and thundersync with the simulated rollout; the file check.py reads."""
    from perf.bench import gpu_step

    out = tmp_path / "dry.json"
    assert gpu_step.main(["--device", "cpu", "--model", "tiny", "--skip-kernels", "--skip-step",
                          "--sweep-fused", "on", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    cells = doc["sweep"]
    assert [(c["n_sources"], c["seq_len"], c["k_open"]) for c in cells] == \
        [(8, 64, 2), (4, 128, 2), (2, 256, 1)]
    for c in cells:
        assert c["status"] == "ok", c
        assert set(c["schedules"]) == {"sync", "thundersync"}
        assert all(r["ok"] and r["active_s"] > 0 for r in c["schedules"].values())
        assert c["speedup_vs_sync"] > 0 and 0 < c["mfu_active"] < 1
        assert c["schedules"]["sync"]["idle_s"] > 0  # sync waited for the last completion
        assert c["tokens_per_batch"] == c["n_sources"] * c["seq_len"]
    rows = check.compare(doc, doc, 0.15)
    assert {r["metric"] for r in rows if r["cell"].startswith("sweep")} == \
        {"mfu_active", "speedup_vs_sync r=1.0"}
    assert all(r["status"] == "ok" for r in rows)


def test_perf_is_a_package_run_from_the_root_without_path_edits():
    # perf/ runs as modules (`python -m perf.bench.run`) with only the checkout's root on the
    # import path: a module that edits sys.path, or imports a sibling by its bare name (which
    # needs perf/ itself on the path), would break that, or shadow packages named alike
    import ast
    import os

    from tests.helpers.paths import ROOT

    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "perf"))
             for f in fs if f.endswith(".py")]
    siblings = {os.path.splitext(os.path.basename(f))[0] for f in files} - {"__init__"}
    assert {"cell", "run", "schedule_runs", "figure1"} <= siblings
    for d, _, fs in os.walk(os.path.join(ROOT, "perf")):
        if any(f.endswith(".py") for f in fs):
            assert "__init__.py" in fs, f"{d}: not a package"
    for path in files:
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" \
                    and isinstance(node.value, ast.Name) and node.value.id == "sys":
                pytest.fail(f"{path}:{node.lineno}: sys.path")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bare = [n for n in names if n.split(".")[0] in siblings]
            assert not bare, f"{path}:{node.lineno}: import {bare[0]} (use perf.bench / perf.studies)"
