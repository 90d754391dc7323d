"""Checkpoint/resume: the update after a resume equals the uninterrupted run's, bitwise."""

import os

import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import write_batches
from tests.helpers.checkpoint_shared import (  # noqa: F401  (shared with the unit tests)
    Touch,
    redigest_file,
)
from tests.helpers.dist_util import run_dist
from tests.helpers.paths import ROOT

WORKER = os.path.join(ROOT, "tests/helpers/workers/resume_worker.py")


def test_resume_is_exact_on_two_ranks_with_distributed_optimizer(tiny_qwen2, tmp_path):
    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, 256, n_updates=4, seed=2)
    run = str(tmp_path / "run")
    # straight and first share a launch (each its own Policy); the resume is a fresh one
    out = run_dist([WORKER, tiny_qwen2, batch, run, "straight,first"], nproc=2)
    assert [[m["version"] for m in r["modes"]] for r in out] == [[4, 2], [4, 2]]
    # the resume, then (same launch) one rank's file corrupted and the resume tried again
    out = run_dist([WORKER, tiny_qwen2, batch, run, "resume,corrupt,refused"], nproc=2)
    assert {r["modes"][0]["version"] for r in out} == {4}
    refused = [r["modes"][2] for r in out]
    a = load_file(os.path.join(run, "params_straight.safetensors"))
    b = load_file(os.path.join(run, "params_resume.safetensors"))
    first = load_file(os.path.join(run, "params_first.safetensors"))
    assert any(not torch.equal(a[k], first[k]) for k in a)  # the resumed updates moved θ
    assert all(torch.equal(a[k], b[k]) for k in a)
    ckpt = os.path.join(run, "checkpoints")
    assert open(os.path.join(ckpt, "latest")).read().strip() == "step_2"
    assert sorted(os.listdir(os.path.join(ckpt, "step_2"))) == [
        "meta.json", "rank0.safetensors", "rank0.sha256", "rank1.safetensors", "rank1.sha256"]
    # One rank's file is corrupt: every rank refuses (none trains on with a half-resume).
    assert all(r["unchanged"] for r in refused)
    assert "refused by 1 other rank" in refused[0]["error"]
    assert "step_2/rank1.safetensors: contents do not match" in refused[1]["error"]


import json  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from tsync_mcore.learner import checkpoint  # noqa: E402


def _pickle_checkpoint(run: str, marker: str, name: str) -> None:
    step = os.path.join(run, "checkpoints", "step_1")
    os.makedirs(step)
    json.dump({"format": checkpoint.FORMAT, "version": 1, "data_pos": 1, "world_size": 1,
               "tp": 1}, open(os.path.join(step, "meta.json"), "w"))
    with open(os.path.join(step, name), "wb") as f:
        pickle.dump({"model": Touch(marker)}, f)
    if name.endswith(".safetensors"):
        redigest_file(os.path.join(step, name))
    open(os.path.join(run, "checkpoints", "latest"), "w").write("step_1")


@pytest.mark.parametrize("name", ["rank0.pt", "rank0.safetensors"])
def test_resume_from_a_pickle_does_not_run_it(tiny_qwen2, tmp_path, name):
    """Through the launcher: one line naming the file, exit 3, no code ran."""
    run, marker = str(tmp_path / "run"), str(tmp_path / "ran")
    _pickle_checkpoint(run, marker, name)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/learner.py"), "--config",
         os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"), "--resume", "--set",
         f"model.hf_dir={tiny_qwen2}", f"run.dir={run}"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert not os.path.exists(marker)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: learner stopped: --resume refused: checkpoint ") and \
        os.path.join(run, "checkpoints", "step_1", "rank0.safetensors") in last, last
