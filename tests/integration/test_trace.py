"""The trace schema: every record kind round-trips, damaged lines are named, the CLIs that
read traces stop with one line (exit 2), and docs/design/trace.md shows the schema as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.records import source
from tests.helpers.trace_shared import record_json  # noqa: F401  (shared with the unit tests)
from tsync_mcore.observability import trace


def _damaged_run(tmp_path) -> str:
    """A run directory whose rank-1 trace has a line of another schema version."""
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps(dict(
        step=1, policy_version=0, schedule="thundersync", objective="grpo",
        step_wall_time_s=2.0, rollout_time_s=1.0, learner_tail_s=0.5,
        publish_time_s=0.1)) + "\n")
    trace.write(str(run / "traces" / "rank0.jsonl"), [source(ready=0.1, start=0.1, end=0.2)])
    bad = record_json(source(rank=1)) | {"schema": 0}
    (run / "traces" / "rank1.jsonl").write_text(json.dumps(bad) + "\n")
    return str(run)


@pytest.mark.parametrize("cli", [
    ["-m", "tsync_mcore.observability.predict", "trace", "RUN"],
    ["-m", "tsync_mcore.observability.report", "RUN", "--out", "OUT"],
    ["-m", "perf.bench.run", "--release-trace", "RUN", "--out", "OUT"],
], ids=["predict", "report", "perf_bench_run"])
def test_cli_stops_on_a_damaged_trace_with_one_line(tmp_path, cli):
    run = _damaged_run(tmp_path)
    out = str(tmp_path / "out")
    argv = [run if a == "RUN" else out if a == "OUT" else a for a in cli]
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "rank1.jsonl:1: trace schema 0" in lines[0] and lines[0].startswith("error: ")
