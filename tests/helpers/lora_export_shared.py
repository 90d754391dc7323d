"""Shared by the tests of lora export: tests/unit/test_lora_export.py,
tests/integration/test_export.py (the TP=2 run)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from tsync_mcore.learner.export import ADAPTER_DIR
from tsync_mcore.learner.export import main as export_main


LORA = {"model.lora.rank": 4, "model.lora.alpha": 8.0,
        "model.lora.targets": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def peft_merged(base_dir: str, adapter_dir: str) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(hf, adapter_dir).merge_and_unload().state_dict()


def check_export(run: str, out: str, base_dir: str) -> None:
    assert export_main([run, "--out", out]) == 0
    live = load_file(os.path.join(run, "learner_final.safetensors"))
    merged = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            merged.update(load_file(os.path.join(out, f)))
    adapter = load_file(os.path.join(out, ADAPTER_DIR, "adapter_model.safetensors"))
    # the exported adapter is the learner's, in PEFT's names
    want = {k[len("adapter."):]: v for k, v in live.items() if k.startswith("adapter.")}
    assert set(adapter) == set(want)
    assert all(torch.equal(adapter[k], want[k]) for k in want)
    # merged weights: the learner's live (published) merge, and peft's merge_and_unload
    ref = peft_merged(base_dir, os.path.join(out, ADAPTER_DIR))
    for k, v in merged.items():
        assert rel(v, live[f"param.{k}"]) <= 1e-6, k
        assert rel(v, ref[k]) <= 1e-6, k
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    changed = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert changed and all(any(p in k for p in ("q_proj", "v_proj", "o_proj", "gate_proj",
                                                 "down_proj")) for k in changed)
