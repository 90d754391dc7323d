"""Checkpoint/resume: the update after a resume equals the uninterrupted run's, bitwise."""

import os

import torch
from safetensors.torch import load_file

from batchgen import write_batches
from dist_util import run_dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/workers/resume_worker.py")


def test_resume_is_exact_on_two_ranks_with_distributed_optimizer(tiny_qwen2, tmp_path):
    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, 256, n_updates=4, seed=2)
    run = str(tmp_path / "run")
    for mode in ("straight", "first", "resume"):
        out = run_dist([WORKER, tiny_qwen2, batch, run, mode], nproc=2)
        assert {r["version"] for r in out} == {2 if mode == "first" else 4}
    a = load_file(os.path.join(run, "params_straight.safetensors"))
    b = load_file(os.path.join(run, "params_resume.safetensors"))
    first = load_file(os.path.join(run, "params_first.safetensors"))
    assert any(not torch.equal(a[k], first[k]) for k in a)  # the resumed updates moved θ
    assert all(torch.equal(a[k], b[k]) for k in a)
    ckpt = os.path.join(run, "checkpoints")
    assert open(os.path.join(ckpt, "latest")).read().strip() == "step_2"
    assert sorted(os.listdir(os.path.join(ckpt, "step_2"))) == [
        "meta.json", "rank0.safetensors", "rank0.sha256", "rank1.safetensors", "rank1.sha256"]
