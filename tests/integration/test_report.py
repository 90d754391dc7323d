"""`python -m tsync_mcore.observability.report` on two small run directories written in the documented
formats (metrics.jsonl rows as the trainer writes them, docs/design/trace.md records): runs whose
rollout times differ are said to differ, release and utilization panels cover every run,
legends stay off the data, and a missing run directory is one line with exit 2."""

import json
import os
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from tests.helpers.paths import ROOT
from tests.helpers.records import source, update
from tsync_mcore.observability import report, trace

REPO = ROOT


def write_run(root, name, schedule, R, service=0.5, updates=3):
    """Two ranks, 4 sources per rank per update, released evenly over R; sync serves after R."""
    run = root / name
    (run / "traces").mkdir(parents=True)
    rows, recs = [], {0: [], 1: []}
    for k in range(updates):
        for r in (0, 1):
            t = R if schedule == "sync" else 0.0
            for j in range(4):
                ready = R * (j + 1) / 4
                start = max(ready, t)
                t = start + service
                recs[r].append(source(update=k, rank=r, traj_id=f"v{k}-r{r}-{j}",
                                      group_id=f"g{r}", ready=ready, start=start, end=t))
            recs[r].append(update(update=k, rank=r, schedule=schedule, n_sources=4))
        end = max(x.end for x in recs[0] + recs[1] if getattr(x, "end", None) is not None
                  and x.update == k)
        rows.append(dict(step=k + 1, policy_version=k, ok=True, schedule=schedule,
                         objective="grpo", step_wall_time_s=end + 0.2, rollout_time_s=R,
                         learner_tail_s=end - R + 0.1, publish_time_s=0.1, reward_mean=0.1 * k,
                         stale_sources=0, mfu_active=0.01, peak_mem_bytes=2**26))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    for r, rs in recs.items():
        trace.write(str(run / "traces" / f"rank{r}.jsonl"), rs)
    return str(run)


@pytest.fixture
def figures(monkeypatch):
    """Keep every figure the report draws open, to look at its legends."""
    kept, close = [], plt.close
    monkeypatch.setattr(report.plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


def legends_off_the_data(figs):
    n = 0
    for fig in figs:
        fig.canvas.draw()
        for ax in fig.axes:
            leg = ax.get_legend()
            if leg is None:
                continue
            a, b = ax.get_window_extent(), leg.get_window_extent()
            assert b.x0 >= a.x1 or b.x1 <= a.x0 or b.y0 >= a.y1 or b.y1 <= a.y0, \
                f"legend over the axes of {ax.get_title()!r}"
            n += 1
    return n


def test_runs_with_different_rollout_times_are_not_compared_by_step_time(tmp_path, figures):
    sync = write_run(tmp_path, "a", "sync", R=4.0)
    stream = write_run(tmp_path, "b", "thundersync", R=5.2)  # a slower rollout
    out = report.main([sync, "--compare", stream, "--out", str(tmp_path / "rep")])
    md = open(os.path.join(out, "summary.md")).read()
    assert "**Rollout times differ**" in md
    assert "R = 5.200 s vs the reference's 4.000 s (ratio 1.30)" in md
    row = next(line for line in md.splitlines() if line.startswith("| b (thundersync)"))
    assert "– (R 1.30× the reference's)" in row  # no step-time speedup
    # what compares: step − R (sync: 4 sources after R = 2.0 + 0.2; streaming: the last
    # source's service 0.5 + 0.2)
    cells = [c.strip() for c in row.split("|")]
    assert float(cells[5]) == pytest.approx(0.7) and cells[9] == f"{2.2 / 0.7:.2f}×"
    # one release and one utilization panel per run, titled with its label
    for name in ("step_breakdown", "release_trace", "utilization", "mfu", "memory", "reward"):
        assert os.path.getsize(os.path.join(out, f"{name}.png")) > 5000, name
    titles = [ax.get_title() for fig in figures for ax in fig.axes]
    for label in ("a (sync)", "b (thundersync)"):
        assert f"{label}: update 2" in titles
        assert f"{label}: learner utilization during update 2" in titles
    assert legends_off_the_data(figures) >= 7


def test_runs_with_the_same_rollout_time_compare_by_step_time(tmp_path, figures):
    sync = write_run(tmp_path, "a", "sync", R=4.0)
    stream = write_run(tmp_path, "b", "thundersync", R=4.1)  # within 10 %
    md = open(os.path.join(report.main([stream, "--compare", sync]), "summary.md")).read()
    assert "Rollout times differ" not in md
    row = next(line for line in md.splitlines() if line.startswith("| b (thundersync)"))
    # reference: the sync run, 4.0 + 2.0 + 0.2 over 4.1 + 0.5 + 0.2
    assert f"{6.2 / 4.8:.2f}×" in row.split("|")[8]


def test_missing_run_dir_is_one_line(tmp_path):
    for args in ([str(tmp_path / "nope")], [str(tmp_path)]):
        proc = subprocess.run([sys.executable, "-m", "tsync_mcore.observability.report", *args],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: ")
