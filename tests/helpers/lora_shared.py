"""Shared by the tests of lora: tests/unit/test_lora.py, tests/integration/test_lora.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.helpers.lora_reference import (
    ALL_TARGETS,
    PEFT_DEFAULT_TARGETS,
    load_peft_model,
    make_peft_adapter,
    read_adapter,
)


FP32_TOL = 1e-5
VOCAB = 256
# adapter name -> (checkpoint variant, targets, rsLoRA)
ADAPTERS = {
    "qwen2_all": ("qwen2", ALL_TARGETS, False),  # QKV bias
    "qwen2_sub": ("qwen2", PEFT_DEFAULT_TARGETS, False),
    "qwen3_all": ("qwen3", ALL_TARGETS, False),  # qk-norm, head_dim != hidden / heads
    "llama_tied_sub": ("llama_tied", PEFT_DEFAULT_TARGETS, False),
    "qwen3_tied_mix": ("qwen3_tied", ("k_proj", "o_proj", "up_proj"), False),
    "llama_rslora": ("llama", ("q_proj", "v_proj", "gate_proj", "down_proj"), True),  # s = α/√r
}


@pytest.fixture(scope="module")
def adapters(tiny_ckpts, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (HF checkpoint dir, PEFT adapter dir); r = 4, α = 8."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (variant, targets, rslora)) in enumerate(ADAPTERS.items()):
        hf = tiny_ckpts[variant]
        out[name] = (hf, make_peft_adapter(hf, str(root / name), targets, r=4, alpha=8.0,
                                           seed=10 + i, use_rslora=rslora))
    return out


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a − b| / max|b|."""
    return max(((a[k].double() - b[k].double()).abs().max()
                / b[k].double().abs().max()).item() for k in b)


def lora_cfg(hf: str, ad: str, **extra):
    from tsync_mcore.config import load_config

    cfg, _ = read_adapter(ad)
    return load_config(None, {"model.hf_dir": hf, "model.lora_init": ad,
                              "model.lora.rank": cfg["r"],
                              "model.lora.alpha": float(cfg["lora_alpha"]),
                              "model.lora.targets": sorted(cfg["target_modules"]), **extra})


def check_merged(got: dict[str, torch.Tensor], hf: str, adapter_dir: str) -> None:
    """Merged HF weights vs peft's merge_and_unload() of the adapter (FP32, ≤ 1e-6 rel)."""
    with torch.no_grad():
        ref = load_peft_model(hf, adapter_dir, torch.float32).merge_and_unload().state_dict()
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    assert set(got) <= set(ref) and "model.layers.0.self_attn.q_proj.weight" in got
    err = max_rel(got, {k: ref[k] for k in got})
    print(f"merged export vs peft merge_and_unload: max rel {err:.2e}")
    assert err <= 1e-6
    _, tensors = read_adapter(adapter_dir)
    adapted = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
               for k in tensors if k.endswith(".lora_A.weight")}
    for k, t in got.items():  # adapted weights moved, the rest are the checkpoint's
        assert torch.equal(t, base[k]) != (k in adapted), k


def rename_first(path) -> None:
    from safetensors.torch import save_file

    tensors = load_file(str(path))
    k = next(iter(tensors))
    tensors[k.replace("layers.0.", "layers.7.")] = tensors.pop(k)  # a layer the model lacks
    save_file(tensors, str(path))


def bad_dirs(good: str, root) -> dict[str, tuple[str, str]]:
    """case -> (adapter dir, the file its error must name)."""
    import shutil

    cfg_name, st_name = "adapter_config.json", "adapter_model.safetensors"
    out = {}

    def variant(case: str, edit_cfg=None, edit_st=None, drop=None) -> None:
        d = root / case
        shutil.copytree(good, d)
        if drop:
            os.remove(d / drop)
        if edit_cfg:
            cfg = json.loads((d / cfg_name).read_text())
            edit_cfg(cfg)
            (d / cfg_name).write_text(json.dumps(cfg))
        if edit_st:
            edit_st(d / st_name)
        named = drop or (cfg_name if edit_cfg else st_name)
        out[case] = (str(d), str(d / named))

    variant("no_config", drop=cfg_name)
    variant("no_weights", drop=st_name)
    variant("dora", edit_cfg=lambda c: c.update(use_dora=True))
    variant("bias", edit_cfg=lambda c: c.update(bias="all"))
    variant("unknown_target", edit_cfg=lambda c: c.update(target_modules=["q_proj", "qkv"]))
    variant("rank_zero", edit_cfg=lambda c: c.update(r=0))
    variant("not_lora", edit_cfg=lambda c: c.update(peft_type="IA3"))
    variant("dropout", edit_cfg=lambda c: c.update(lora_dropout=0.1))
    variant("rank_pattern", edit_cfg=lambda c: c.update(rank_pattern={"q_proj": 8}))
    variant("bad_name", edit_st=lambda p: rename_first(p))

    def truncate(p):
        raw = p.read_bytes()
        p.write_bytes(raw[: len(raw) // 2])

    variant("truncated", edit_st=truncate)

    def not_json(d):
        (d / cfg_name).write_text("{\"r\": 4,")

    d = root / "config_not_json"
    shutil.copytree(good, d)
    not_json(d)
    out["config_not_json"] = (str(d), str(d / cfg_name))
    return out
