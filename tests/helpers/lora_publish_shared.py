"""Shared by the tests of lora publish: tests/unit/test_lora_publish.py,
tests/integration/test_lora_publish.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.batchgen import write_batches
from tests.helpers.workers.export_worker import train


# vLLM's CPU attention needs head_dim >= 32 (tests/test_rollout.py)
VLLM_TINY = dict(arch="qwen2", vocab_size=300, hidden=64, layers=2, heads=2, kv_heads=1)
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # k_proj, up_proj not
RANK, ALPHA = 4, 8.0


def peft_adapter(base: str, out: str, targets=TARGETS, seed: int = 7) -> str:
    """A PEFT adapter saved by peft, A and B both non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(out)
    return out


def lora_overrides(init: str) -> dict:
    return {"model.lora.rank": RANK, "model.lora_init": init}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("lora_base") / "m"), seed=4,
                                **VLLM_TINY)


@pytest.fixture(scope="module")
def lora_run(base, parallel1, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lora_tp1")
    batch = str(root / "b.jsonl")
    write_batches(batch, 300, n_updates=2, seed=5)
    init = peft_adapter(base, str(root / "init"))
    run = str(root / "run")
    assert train(base, batch, run, tp=1, updates=2, par=parallel1,
                 overrides=lora_overrides(init))["version"] == 2
    return run
