"""perf/check.py (regression guard), perf/kernels.py (smoke on tiny shapes), perf/gpu.sh (no GPU)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT
PERF = os.path.join(ROOT, "perf")

import check  # noqa: E402
import kernels  # noqa: E402


def _cell(schedule: str, measured: float, predicted: float) -> dict:
    return {"objective": "grpo", "schedule": schedule, "ratio": 2.0, "batch": 64,
            "step_time_s": 10.0 / measured, "speedup_measured": measured,
            "speedup_predicted": predicted, "mfu_active": 0.3}  # fmt: skip


def _kernel(name: str, impl: str, time_s: float, bytes_per_s: float | None = None) -> dict:
    return {"name": name, "impl": impl, "shape": {"numel": 1024}, "time_s": time_s,
            "peak_mem_bytes": 0, "bytes_per_s": bytes_per_s}  # fmt: skip


def _doc() -> dict:
    return {
        "machine": "test-box",
        "date": "2025-01-01",
        "overlap": [_cell("thundersync", 1.8, 2.0), _cell("group_ready", 1.3, 1.4)],
        "kernels": [
            _kernel("stream_bandwidth", "copy_", 1.0, 100.0),
            _kernel("accumulate_g1g2", "plain", 2.0, 40.0),
            _kernel("accumulate_g1g2", "fused-triton", 1.0, 80.0),
        ],
    }


def _run_check(tmp_path, result: dict, baseline: dict, *flags: str) -> subprocess.CompletedProcess:
    res, base = tmp_path / "result.json", tmp_path / "baseline.json"
    res.write_text(json.dumps(result))
    base.write_text(json.dumps(baseline))
    cmd = [sys.executable, os.path.join(PERF, "check.py"), str(res), "--baseline", str(base), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_check_passes_on_equal_ratios_at_other_absolute_speed(tmp_path):
    result = _doc()
    for rec in result["kernels"]:  # a machine twice as fast: ratios unchanged
        rec["time_s"] /= 2
        rec["bytes_per_s"] *= 2
    for cell in result["overlap"]:
        cell["step_time_s"] /= 2
    out = _run_check(tmp_path, result, _doc())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 regression" in out.stdout


def test_check_notes_a_different_host_setup(tmp_path):
    result, base = _doc(), _doc()
    for cell in result["overlap"]:
        cell["host"] = {"batch_sched": True, "pin": True, "realtime_io": False}
    out = _run_check(tmp_path, result, base)
    assert out.returncode == 0 and "note: overlap host set-up differs" in out.stdout
    assert '"realtime_io": false' in out.stdout
    assert "host set-up" not in _run_check(tmp_path, result, result).stdout


def test_check_names_overlap_regression(tmp_path):
    result = _doc()
    result["overlap"][0]["speedup_measured"] = 1.4  # -22 %: beyond 15 %
    out = _run_check(tmp_path, result, _doc())
    assert out.returncode == 1
    fail = out.stdout.split("FAIL")[1]
    assert "grpo/thundersync ratio=2.0 batch=64" in fail and "speedup_measured" in fail
    assert "group_ready" not in fail
    assert "host was busy" not in out.stdout
    # within a looser tolerance it passes
    assert _run_check(tmp_path, result, _doc(), "--tolerance", "0.3").returncode == 0
    # a cell the benchmark flagged as run on a busy host: the failure says so
    result["overlap"][0]["host_busy"] = True
    out = _run_check(tmp_path, result, _doc())
    assert out.returncode == 1
    assert ("note: overlap grpo/thundersync ratio=2.0 batch=64: the host was busy during this "
            "cell") in out.stdout


def test_overlap_flags_cells_run_on_a_busy_host():
    from overlap import mark_busy_host

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


def test_check_names_kernel_regression(tmp_path):
    result = _doc()
    result["kernels"][2]["time_s"] = 1.5  # fused/plain 0.5 -> 0.75
    result["kernels"][2]["bytes_per_s"] = 53.0  # bandwidth fraction 0.8 -> 0.53
    out = _run_check(tmp_path, result, _doc())
    assert out.returncode == 1
    fail = out.stdout.split("FAIL")[1]
    assert "accumulate_g1g2[fused-triton]" in fail
    assert "time/plain" in fail and "bw_fraction" in fail


def test_check_names_gpu_step_mfu_regression(tmp_path):
    step = {"backend": "megatron", "n_sources": 16, "seq_len": 2048, "attention": "causal",
            "mfu_active": 0.30}
    base, result = {**_doc(), "step": step}, {**_doc(), "step": {**step, "mfu_active": 0.20}}
    p = _run_check(tmp_path, result, base)
    assert p.returncode == 1 and "learner step megatron 16x2048" in p.stdout
    assert "REGRESSION" in p.stdout.upper()
    # a failed step (error recorded, no MFU) is missing, not a crash
    p = _run_check(tmp_path, {**_doc(), "step": {"backend": "megatron", "error": "OOM"}}, base)
    assert p.returncode == 0 and "MISSING" in p.stdout


def test_check_missing_cells_fail_only_when_strict(tmp_path):
    result = _doc()
    del result["overlap"][1]
    out = _run_check(tmp_path, result, _doc())
    assert out.returncode == 0
    assert "MISSING" in out.stdout and "group_ready" in out.stdout
    strict = _run_check(tmp_path, result, _doc(), "--strict")
    assert strict.returncode == 1
    assert "group_ready" in strict.stdout.split("FAIL")[1]


def test_check_write_baseline_and_bad_input(tmp_path):
    res, base = tmp_path / "r.json", tmp_path / "sub" / "b.json"
    res.write_text(json.dumps(_doc()))
    cmd = [sys.executable, os.path.join(PERF, "check.py"), str(res), "--baseline", str(base)]
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--write-baseline" in missing.stderr
    assert subprocess.run(cmd + ["--write-baseline"], capture_output=True, timeout=60).returncode == 0
    assert json.loads(base.read_text()) == _doc()
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0


def test_check_noise_measured_over_runs_widens_only_those_cells(tmp_path):
    # Three runs of the same code: the fused/plain time ratio 0.5, 0.6, 0.8 (range +60 %).
    runs = []
    for i, t in enumerate((1.0, 1.2, 1.6)):
        doc = _doc()
        doc["kernels"][2]["time_s"] = t
        runs.append(tmp_path / f"run{i}.json")
        runs[-1].write_text(json.dumps(doc))
    base = tmp_path / "base.json"
    cmd = [sys.executable, os.path.join(PERF, "check.py"), str(runs[0]), "--baseline", str(base),
           "--write-baseline", "--noise-from", str(runs[1]), str(runs[2])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    written = json.loads(base.read_text())
    key = "kernel accumulate_g1g2[fused-triton] numel=1024 | time/plain"
    assert written["noise"][key] == pytest.approx(0.6)
    assert written["noise_from"] == ["run1.json", "run2.json", "run0.json"]
    baseline = written  # its time/plain is 0.5: +50 % is within the noise, +70 % is not
    result = _doc()
    result["kernels"][2]["time_s"] = 1.5
    rows = {(r["cell"], r["metric"]): r for r in check.compare(result, baseline, 0.15)}
    row = rows["kernel accumulate_g1g2[fused-triton] numel=1024", "time/plain"]
    assert row["status"] == "ok" and row["tolerance"] == pytest.approx(0.6)
    result["kernels"][2]["time_s"] = 1.7
    rows = {(r["cell"], r["metric"]): r for r in check.compare(result, baseline, 0.15)}
    cell = "kernel accumulate_g1g2[fused-triton] numel=1024"
    assert rows[cell, "time/plain"]["status"] == "regression"
    # the other cells keep the default tolerance: bw_fraction moved too (80 → 53 bytes/s)
    result["kernels"][2]["bytes_per_s"] = 53.0
    rows = {(r["cell"], r["metric"]): r for r in check.compare(result, baseline, 0.15)}
    assert rows[cell, "bw_fraction"]["status"] == "regression"
    bad = subprocess.run(cmd[:5] + ["--noise-from", str(runs[1])], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--noise-from goes with --write-baseline" in bad.stderr


def test_compare_improvement_is_not_a_regression():
    result = copy.deepcopy(_doc())
    result["kernels"][2]["time_s"] = 0.5
    result["overlap"][0]["speedup_measured"] = 2.5
    rows = check.compare(result, _doc(), 0.15)
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
def test_gpu_sh_exits_zero_without_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", os.path.join(PERF, "gpu.sh")], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_step_exits_zero_without_gpu(capsys, tmp_path):
    import gpu_step

    assert gpu_step.main(["--json", str(tmp_path / "x.json")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()


def test_overlap_workload_is_valid_and_follows_the_release_model():
    # The simulator's sources must pass the learner's own validation, arrive within R,
    # and grow with completion time (service ∝ U^γ).
    from overlap import Workload
    from tsync_mcore.channel.sources import opd_turns_from_json, validate_source, validate_turn  # noqa: F401

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
    from overlap import plan_steps

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
    from overlap import SCHEDULES, _segment, plan_steps

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
            assert _segment(steps, start) == seg  # consecutive
    assert firsts == set(SCHEDULES)
    with pytest.raises(ValueError, match="sync"):
        plan_steps(1, schedules=("thundersync", "one_step_off"))


def test_one_step_off_samples_each_batch_with_the_previous_version():
    from async_rollout import one_step_off_sampler

    assert [one_step_off_sampler(b, 5) for b in range(5, 9)] == [5, 5, 6, 7]


def _drive_fully_async(G: int, staleness: int, L: float, durations: list[float], batches: int):
    """The stream against a learner taking L per batch (fake clock): it trains batch k once
    registered and θ_k published, and publishes θ_{k+1} L later. Returns (stream, log of
    registrations (time, k, group versions), max groups started before each load)."""
    from async_rollout import FullyAsyncStream

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
    from async_rollout import StreamGroup
    from overlap import Workload, _stream_batch
    from tsync_mcore.channel.sources import validate_source

    w = Workload(objective="grpo", batch=16)
    plan, n_turns, items = w.update(7, R=1.0, draw=0)
    gids = list(plan.groups)
    members = {g: [(t, src) for t, src in items if src.group_id == g] for g in gids}
    batch = [StreamGroup(5, 6, 0.0, 1.0), StreamGroup(1, 7, 0.0, 1.0),
             StreamGroup(9, 7, 0.0, 1.0), StreamGroup(4, 6, 0.0, 1.0)]
    bplan, _, bitems = _stream_batch(7, batch, gids, members, n_turns)
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
    from overlap import RecordedWorkload
    from tests.helpers.records import deferred, source
    from tsync_mcore.observability import trace
    from tsync_mcore.channel.sources import validate_turn

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


def test_compare_report_from_metrics_rows(tmp_path):
    # perf/compare.py's figures and table from hand-written metrics rows: the training clock
    # sums step times, the lag and dropped groups come from the rows, a skipped batch counts
    # nowhere.
    import compare

    def row(step, wall, reward, lag=None, **kw):
        return dict(step=step, ok=True, step_wall_time_s=wall, reward_mean=reward,
                    policy_lag_mean=lag, policy_lag_max=None if lag is None else int(lag + 0.5),
                    stale_sources=0, **kw)

    runs = {"sync": [row(i + 1, 2.0, 0.1 * i) for i in range(8)],
            "one_step_off": [row(1, 1.0, 0.0, 0.0)] + [row(i + 1, 1.0, 0.05 * i, 1.0)
                                                       for i in range(1, 16)],
            "fully_async": [row(1, 1.0, 0.2, 0.5, **{"async/dropped_stale_groups": 2.0}),
                            dict(step=1, ok=False, skipped="non-finite"),
                            row(2, 1.0, 0.3, 1.0, **{"async/dropped_stale_groups": 1.0})]}
    compare.report(runs, str(tmp_path), budget_s=16.0)
    for name in ("reward_vs_time", "reward_vs_updates", "policy_lag"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    table = {r["schedule"]: r for r in compare.summary_rows(runs)}
    assert table["sync"]["train_s"] == 16.0 and table["sync"]["updates"] == 8
    assert table["sync"]["reward_first"] == pytest.approx(0.05)  # first quarter: 2 updates
    assert table["sync"]["policy_lag_mean"] is None
    assert table["one_step_off"]["policy_lag_max"] == 1
    assert table["one_step_off"]["policy_lag_mean"] == pytest.approx(15 / 16)
    assert table["fully_async"]["updates"] == 2
    assert table["fully_async"]["dropped_stale_groups"] == 3
    md = (tmp_path / "summary.md").read_text()
    assert "| one_step_off | 16 | 16.0 |" in md and "16 s of training each" in md
    # sync's rewards 0.0, 0.1, …: the mean of 3 first reaches 0.5 at update 7 (0.4, 0.5, 0.6)
    assert compare.reached(compare.curves(runs["sync"]), 0.5) == (14.0, 7)
    assert compare.reached(compare.curves(runs["sync"]), 0.9) is None
    bad = subprocess.run([sys.executable, os.path.join(PERF, "compare.py"), "--schedules",
                          "sync,async"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown async" in bad.stderr


def _sweep_cell(fused, mfu: float, speedup: float, status: str = "ok") -> dict:
    return {"model": "1.5b", "n_sources": 16, "seq_len": 2048, "fused_lm_head": fused,
            "attention": "causal", "ratio": 1.0, "status": status, "mfu_active": mfu,
            "speedup_vs_sync": speedup}  # fmt: skip


def test_check_names_gpu_sweep_regressions_and_skips_cells_that_did_not_run(tmp_path):
    base = {**_doc(), "sweep": [_sweep_cell(True, 0.40, 1.9), _sweep_cell(False, 0.35, 1.8)]}
    worse = {**_doc(), "sweep": [_sweep_cell(True, 0.40, 1.2), _sweep_cell(False, 0.35, 1.8)]}
    p = _run_check(tmp_path, worse, base)
    assert p.returncode == 1 and "sweep 1.5b 16x2048 fused_head=on" in p.stdout
    assert "speedup_vs_sync r=1.0" in p.stdout
    oom = {**_doc(), "sweep": [_sweep_cell(True, 0.40, 1.9), _sweep_cell(False, 0, 0, "oom")]}
    p = _run_check(tmp_path, oom, base)
    assert p.returncode == 0 and "MISSING" in p.stdout  # an oom cell has no metrics
    assert _run_check(tmp_path, oom, base, "--strict").returncode == 1
    p = _run_check(tmp_path, {**_doc(), "sweep": {"not": "a list"}}, base)
    assert p.returncode == 2 and "'sweep'" in p.stderr


def test_sweep_clock_skips_idle_waits_only():
    import gpu_sweep

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
    import gpu_step

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
