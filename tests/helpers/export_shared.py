"""Shared by the tests of export: tests/unit/test_export.py, tests/integration/test_export.py,
tests/unit/test_moe.py."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import write_batches
from tests.helpers.workers.export_worker import PROBE, train
from tsync_mcore.learner.export import main as export_main


# vLLM's CPU attention needs head_dim >= 32: 2 heads of 32 (tests/test_rollout.py does too)
VLLM_TINY = dict(arch="qwen2", vocab_size=300, hidden=64, layers=2, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory) -> str:
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("vllm_tiny") / "m"), seed=4,
                                **VLLM_TINY)


@pytest.fixture(scope="module")
def tp1_run(vllm_tiny, parallel1, tmp_path_factory) -> str:
    """Two real updates (cosine schedule, weight decay) at TP=1, checkpointed at step_2."""
    root = tmp_path_factory.mktemp("tp1")
    batch = str(root / "b.jsonl")
    write_batches(batch, 300, n_updates=2, seed=5)
    run = str(root / "run")
    assert train(vllm_tiny, batch, run, tp=1, updates=2, par=parallel1)["version"] == 2
    return run


def export_run(run: str, out: str, *flags: str) -> int:
    return export_main([run, "--out", out, *flags])


def hf_logits(hf_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits.float()


def exported_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf_dir, name)))
    return out


def check_against_learner(run: str, out: str) -> float:
    ref = load_file(os.path.join(run, "learner_final.safetensors"))
    params = {k[len("param."):]: v for k, v in ref.items() if k.startswith("param.")}
    got = exported_tensors(out)
    assert got.keys() == params.keys()
    assert all(torch.equal(got[k], params[k]) for k in params)  # bit for bit, FP32
    err = float((hf_logits(out) - ref["logits"]).abs().max())
    assert err <= 1e-5, err
    return err
