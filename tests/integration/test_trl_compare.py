"""perf/studies/trl_compare.py's GRPOConfig keyword arguments, taken by TRL 1.16.0 itself in the venv
the script installs (runs/trl-venv, or $TSYNC_TRL_VENV); skipped where there is none."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from perf.studies import trl_compare as tc
from tests.helpers.trl_compare_shared import tsync_cfg

VENV = os.environ.get("TSYNC_TRL_VENV", os.path.join(tc.ROOT, "runs", "trl-venv"))
PY = os.path.join(VENV, "bin", "python")


@pytest.mark.skipif(not os.path.exists(PY), reason=f"no TRL venv at {VENV} (perf/studies/trl_compare.py "
                                                   f"installs it; TSYNC_TRL_VENV names another)")
@pytest.mark.parametrize("sets, loss, scale", [
    ({}, "dapo", "group"),
    ({"learner.objective": "dr_grpo", "learner.adv_std": "population",
      "learner.token_norm": "seq_mean_token_mean"}, "grpo", "none"),
])
def test_trl_takes_the_grpo_kwargs(tmp_path, sets, loss, scale):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"grpo": tc.grpo_kwargs(tsync_cfg(tmp_path, sets),
                                                       str(tmp_path / "out"))}))
    r = subprocess.run([PY, "-m", "perf.studies.trl_runner", str(spec), "--check"],
                       check=False, capture_output=True, text=True, timeout=300, cwd=tc.ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # one update = one generation batch of groups × group size = one optimizer step
    assert got == {"loss_type": loss, "scale_rewards": scale, "generation_batch_size": 8,
                   "steps_per_generation": 1}
