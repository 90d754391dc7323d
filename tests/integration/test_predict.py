"""Speedup predictor: trace replay (Eq. 14-17) and analytic release laws (Eq. 19-28) against
hand-computed answers and every figure quoted in the paper's appendix F.6."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers.predict_shared import (  # noqa: F401  (shared with the unit tests)
    REPO,
    close_to,
    write_run,
)
from tsync_mcore.observability.predict import analytic


def test_module_entry_point(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "tsync_mcore.observability.predict", "analytic", "--objective", "opd",
         "--batch", "64", "--ratio", "0.5", "--turns", "40", "--peak", "--json"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60, check=True)
    out = json.loads(proc.stdout)
    assert close_to(out["peak_speedup"], 1.95) and math.isfinite(out["tail"])
    proc = subprocess.run([sys.executable, "-m", "tsync_mcore.observability.predict", "trace",
                           write_run(tmp_path), "--json"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60, check=True)
    assert "speedup_predicted" in json.loads(proc.stdout)


def test_analytic_reports_one_step_off_speedup():
    from tsync_mcore.observability.predict import async_speedup

    res = analytic("grpo", 64, 1.0, 1)
    # B = 64 < Q: one wave, rho_w = 0.5, kappa 0.05: (1 + 0.5 + 0.05) / max(1, 0.55)
    assert res["speedup_one_step_off"] == pytest.approx(1.55)
    assert async_speedup(0.5, 0.0) == pytest.approx(1.5)  # learner-bound: (1 + 2) / 2
    out = subprocess.run([sys.executable, "-m", "tsync_mcore.observability.predict", "analytic", "--objective",
                          "grpo", "--batch", "64", "--turns", "1"], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode == 0 and "one_step_off 1.5500x at policy lag 1" in out.stdout
