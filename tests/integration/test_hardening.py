"""Bad input and broken numerics: configs, source bounds, and the step guard.

Every case here must end in a typed error whose message names the problem and the place (a
config key, a file, a source), and a non-finite update must never step: θ and the optimizer
stay as they were, so the run that skipped it matches the run that never saw it, bit for bit.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.dist_util import parse_results
from tests.helpers.paths import ROOT
from tsync_mcore.util.net import free_port as _free_port


def test_launcher_prints_one_error_line_for_a_bad_config(tmp_path):
    """The rollout launcher (it reads its config before importing the engine) and the
    learner launcher, which validates before torch.distributed starts."""
    for script in ("launch/rollout.py", "launch/learner.py"):
        p = subprocess.run([sys.executable, os.path.join(ROOT, script), "--config",
                            os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"), "--set",
                            "channel.timeout_s=.inf", f"run.dir={tmp_path}"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, p.stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and "channel.timeout_s" in \
            lines[0] and "Traceback" not in p.stderr, p.stderr


def _worker(hf_dir, out, mode, check):
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(_free_port()), os.path.join(ROOT, "tests/helpers/workers/nonfinite_worker.py"), hf_dir,
         str(out), mode, check], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = parse_results(p.stdout)
    return {r["rank"]: r["results"] for r in rows}


@pytest.mark.parametrize("check", ["update", "source"])
def test_a_non_finite_update_never_steps_and_leaves_no_trace_in_theta_or_adam(tiny_qwen2,
                                                                              tmp_path, check):
    """A, P, B where P's gradient overflows FP32 on rank 0 only: both ranks skip P, and the
    parameters after B equal those of the run A, B bit for bit (so Adam's moments and step
    count were untouched too)."""
    poisoned = _worker(tiny_qwen2, tmp_path, "poisoned", check)
    clean = _worker(tiny_qwen2, tmp_path, "clean", check)
    for rank in (0, 1):
        a, p, b = poisoned[rank]
        assert a["ok"] and b["ok"] and not p["ok"], poisoned[rank]
        assert [a["version"], p["version"], b["version"]] == [1, 1, 2]
        assert [r["grad_norm"] for r in (a, b)] == [r["grad_norm"] for r in clean[rank]]
    named = poisoned[0][1]["nonfinite"] + poisoned[1][1]["nonfinite"]
    if check == "source":  # the unit that broke the sums, on the rank that owns its group
        assert len(named) == 1 and "(group 'v1-g0')" in named[0], named
    else:
        assert named == []
    x = load_file(str(tmp_path / f"params_poisoned_{check}.safetensors"))
    y = load_file(str(tmp_path / f"params_clean_{check}.safetensors"))
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_replay_of_a_non_finite_update_fails_and_writes_nothing(tiny_qwen2, tmp_path):
    """The replay command used to report rc 0 with grad_norm [NaN] and write the NaN θ."""
    from tests.helpers.batchgen import make_batch
    rows = sorted(make_batch(256, n_groups=3, m=3, version=0, seed=2),
                  key=lambda r: r["ready_order"])
    g = rows[0]["group_id"]
    members = [r["traj_id"] for r in rows if r["group_id"] == g]
    for r in rows:
        if r["group_id"] == g:
            r["reward"] = 1e-300 if r["traj_id"] == members[1] else 0.0
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("learner:\n  adv_eps: 1.0e-300\n  check_finite: source\n")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "tsync_mcore.learner.replay", "--model", tiny_qwen2,
                        "--batch", str(batch), "--out", str(out), "--config", str(cfg)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    err = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 3 and len(err) == 1, p.stderr[-3000:]
    assert "reduced gradient is not finite" in err[0] and f"(group '{g}')" in err[0], err
    assert "Traceback" not in p.stderr and not out.exists()
