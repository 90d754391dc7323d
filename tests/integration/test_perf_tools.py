"""perf/bench/check.py (regression guard), perf/bench/kernels.py (smoke on tiny shapes), perf/gpu.sh (no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT

PERF = os.path.join(ROOT, "perf")
CHECK = [sys.executable, "-m", "perf.bench.check"]  # run from ROOT (cwd)


from perf.bench import check  # noqa: E402
from tests.helpers.perf_shared import result_doc


def _run_check(tmp_path, result: dict, baseline: dict, *flags: str) -> subprocess.CompletedProcess:
    res, base = tmp_path / "result.json", tmp_path / "baseline.json"
    res.write_text(json.dumps(result))
    base.write_text(json.dumps(baseline))
    cmd = [*CHECK, str(res), "--baseline", str(base), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_check_passes_on_equal_ratios_at_other_absolute_speed(tmp_path):
    result = result_doc()
    for rec in result["kernels"]:  # a machine twice as fast: ratios unchanged
        rec["time_s"] /= 2
        rec["bytes_per_s"] *= 2
    for cell in result["overlap"]:
        cell["step_time_s"] /= 2
    out = _run_check(tmp_path, result, result_doc())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 regression" in out.stdout


def test_check_notes_a_different_host_setup(tmp_path):
    result, base = result_doc(), result_doc()
    for cell in result["overlap"]:
        cell["host"] = {"batch_sched": True, "pin": True, "realtime_io": False}
    out = _run_check(tmp_path, result, base)
    assert out.returncode == 0 and "note: overlap host set-up differs" in out.stdout
    assert '"realtime_io": false' in out.stdout
    assert "host set-up" not in _run_check(tmp_path, result, result).stdout


def test_check_names_overlap_regression(tmp_path):
    result = result_doc()
    result["overlap"][0]["speedup_measured"] = 1.4  # -22 %: beyond 15 %
    out = _run_check(tmp_path, result, result_doc())
    assert out.returncode == 1
    fail = out.stdout.split("FAIL")[1]
    assert "grpo/thundersync ratio=2.0 batch=64" in fail and "speedup_measured" in fail
    assert "group_ready" not in fail
    assert "host was busy" not in out.stdout
    # within a looser tolerance it passes
    assert _run_check(tmp_path, result, result_doc(), "--tolerance", "0.3").returncode == 0
    # a cell the benchmark flagged as run on a busy host: the failure says so
    result["overlap"][0]["host_busy"] = True
    out = _run_check(tmp_path, result, result_doc())
    assert out.returncode == 1
    assert ("note: overlap grpo/thundersync ratio=2.0 batch=64: the host was busy during this "
            "cell") in out.stdout


def test_check_names_kernel_regression(tmp_path):
    result = result_doc()
    result["kernels"][2]["time_s"] = 1.5  # fused/plain 0.5 -> 0.75
    result["kernels"][2]["bytes_per_s"] = 53.0  # bandwidth fraction 0.8 -> 0.53
    out = _run_check(tmp_path, result, result_doc())
    assert out.returncode == 1
    fail = out.stdout.split("FAIL")[1]
    assert "accumulate_g1g2[fused-triton]" in fail
    assert "time/plain" in fail and "bw_fraction" in fail


def test_check_names_gpu_step_mfu_regression(tmp_path):
    step = {"backend": "megatron", "n_sources": 16, "seq_len": 2048, "attention": "causal",
            "mfu_active": 0.30}
    base, result = {**result_doc(), "step": step}, {**result_doc(), "step": {**step, "mfu_active": 0.20}}
    p = _run_check(tmp_path, result, base)
    assert p.returncode == 1 and "learner step megatron 16x2048" in p.stdout
    assert "REGRESSION" in p.stdout.upper()
    # a failed step (error recorded, no MFU) is missing, not a crash
    p = _run_check(tmp_path, {**result_doc(), "step": {"backend": "megatron", "error": "OOM"}}, base)
    assert p.returncode == 0 and "MISSING" in p.stdout


def test_check_missing_cells_fail_only_when_strict(tmp_path):
    result = result_doc()
    del result["overlap"][1]
    out = _run_check(tmp_path, result, result_doc())
    assert out.returncode == 0
    assert "MISSING" in out.stdout and "group_ready" in out.stdout
    strict = _run_check(tmp_path, result, result_doc(), "--strict")
    assert strict.returncode == 1
    assert "group_ready" in strict.stdout.split("FAIL")[1]


def test_check_write_baseline_and_bad_input(tmp_path):
    res, base = tmp_path / "r.json", tmp_path / "sub" / "b.json"
    res.write_text(json.dumps(result_doc()))
    cmd = [*CHECK, str(res), "--baseline", str(base)]
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert missing.returncode == 2 and "--write-baseline" in missing.stderr
    assert subprocess.run(cmd + ["--write-baseline"], capture_output=True, timeout=60, cwd=ROOT).returncode == 0
    assert json.loads(base.read_text()) == result_doc()
    assert subprocess.run(cmd, capture_output=True, timeout=60, cwd=ROOT).returncode == 0


def test_check_noise_measured_over_runs_widens_only_those_cells(tmp_path):
    # Three runs of the same code: the fused/plain time ratio 0.5, 0.6, 0.8 (range +60 %).
    runs = []
    for i, t in enumerate((1.0, 1.2, 1.6)):
        doc = result_doc()
        doc["kernels"][2]["time_s"] = t
        runs.append(tmp_path / f"run{i}.json")
        runs[-1].write_text(json.dumps(doc))
    base = tmp_path / "base.json"
    cmd = [*CHECK, str(runs[0]), "--baseline", str(base),
           "--write-baseline", "--noise-from", str(runs[1]), str(runs[2])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    written = json.loads(base.read_text())
    key = "kernel accumulate_g1g2[fused-triton] numel=1024 | time/plain"
    assert written["noise"][key] == pytest.approx(0.6)
    assert written["noise_from"] == ["run1.json", "run2.json", "run0.json"]
    baseline = written  # its time/plain is 0.5: +50 % is within the noise, +70 % is not
    result = result_doc()
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
    bad = subprocess.run(cmd[:6] + ["--noise-from", str(runs[1])], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--noise-from goes with --write-baseline" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_sh_exits_zero_without_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(["bash", os.path.join(PERF, "gpu.sh")], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU" in out.stdout


def test_compare_report_from_metrics_rows(tmp_path):
    # perf/studies/compare.py's figures and table from hand-written metrics rows: the training clock
    # sums step times, the lag and dropped groups come from the rows, a skipped batch counts
    # nowhere.
    from perf.studies import compare

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
    bad = subprocess.run([sys.executable, "-m", "perf.studies.compare", "--schedules",
                          "sync,async"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown async" in bad.stderr


def _sweep_cell(fused, mfu: float, speedup: float, status: str = "ok") -> dict:
    return {"model": "1.5b", "n_sources": 16, "seq_len": 2048, "fused_lm_head": fused,
            "attention": "causal", "ratio": 1.0, "status": status, "mfu_active": mfu,
            "speedup_vs_sync": speedup}  # fmt: skip


def test_check_names_gpu_sweep_regressions_and_skips_cells_that_did_not_run(tmp_path):
    base = {**result_doc(), "sweep": [_sweep_cell(True, 0.40, 1.9), _sweep_cell(False, 0.35, 1.8)]}
    worse = {**result_doc(), "sweep": [_sweep_cell(True, 0.40, 1.2), _sweep_cell(False, 0.35, 1.8)]}
    p = _run_check(tmp_path, worse, base)
    assert p.returncode == 1 and "sweep 1.5b 16x2048 fused_head=on" in p.stdout
    assert "speedup_vs_sync r=1.0" in p.stdout
    oom = {**result_doc(), "sweep": [_sweep_cell(True, 0.40, 1.9), _sweep_cell(False, 0, 0, "oom")]}
    p = _run_check(tmp_path, oom, base)
    assert p.returncode == 0 and "MISSING" in p.stdout  # an oom cell has no metrics
    assert _run_check(tmp_path, oom, base, "--strict").returncode == 1
    p = _run_check(tmp_path, {**result_doc(), "sweep": {"not": "a list"}}, base)
    assert p.returncode == 2 and "'sweep'" in p.stderr


def test_schedule_runs_keeps_a_failed_runs_verdict_and_reads_finished_ones(tmp_path, capsys):
    # the driver behind compare, figure1 and the TRL side-by-side: one launch/run.py per
    # schedule, read back from its run directory. A config the launcher refuses exits 2
    # before any process starts: its line is kept in the log and shown, FAILED says why,
    # and read_run (what --report-only reads) gives the same verdict.
    from perf.bench import schedule_runs

    run_dir, log = tmp_path / "sync", tmp_path / "logs" / "sync.out"
    run = schedule_runs.launch("sync", os.path.join(ROOT, "configs", "grpo_cpu_tiny.yaml"),
                               [f"run.dir={run_dir}", "learner.schedule=nope"], str(run_dir),
                               log=str(log), echo="   ")
    assert run.failed == f"launch/run.py exit 2, see {log}" and run.rows == []
    assert run.wall_s is not None and run.wall_s > 0
    assert "learner.schedule" in log.read_text() and "   error: run: " in capsys.readouterr().out
    assert schedule_runs.read_run("sync", str(run_dir)).failed == run.failed
    # a finished run: its metrics rows in file order (blank lines skipped), no verdict
    (run_dir / "FAILED").unlink()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2}\n')
    assert schedule_runs.read_run("sync", str(run_dir)) == schedule_runs.ScheduleRun(
        "sync", str(run_dir), [{"step": 1}, {"step": 2}])
