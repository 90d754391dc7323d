"""LoRA runs: checkpoints (adapters only, resume), export (merged HF weights + a PEFT adapter
directory), the adapter's TP layout, and the config/adapter-directory checks.

The references: the learner's own live merged export and adapter, and `peft` itself
(`PeftModel.from_pretrained(...).merge_and_unload()` of the exported adapter on the base)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import write_batches
from tests.helpers.lora_export_shared import LORA, check_export
from tests.helpers.workers.export_worker import train  # noqa: E402


def test_lora_checkpoint_export_tp1(tiny_qwen3, parallel1, tmp_path):
    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, 256, n_updates=2, seed=5)
    run = str(tmp_path / "run")
    assert train(tiny_qwen3, batch, run, tp=1, updates=2, par=parallel1,
                 overrides=LORA)["version"] == 2
    ckpt = os.path.join(run, "checkpoints", "step_2")
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "rslora": False,
                            "targets": LORA["model.lora.targets"]}
    names = [k for k in load_file(os.path.join(ckpt, "rank0.safetensors")) if k.startswith("model.")]
    assert names and all(".lora." in k for k in names)  # the frozen base is not saved
    check_export(run, str(tmp_path / "hf"), tiny_qwen3)


def test_lora_resume_refuses_another_adapter(tiny_qwen3, parallel1, tmp_path):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner import checkpoint
    from tsync_mcore.learner.policy import Policy
    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, 256, n_updates=1, seed=7)
    run = str(tmp_path / "run")
    train(tiny_qwen3, batch, run, tp=1, updates=1, par=parallel1,
          overrides={**LORA, "optim.warmup_updates": 0})
    ckpt = checkpoint.latest(run)
    base = {"model.hf_dir": tiny_qwen3, "run.dir": run}
    same = Policy(load_config(None, {**base, **LORA}), par=parallel1)
    checkpoint.load(ckpt, same)
    live = {k[len("adapter."):]: v for k, v in
            load_file(os.path.join(run, "learner_final.safetensors")).items()
            if k.startswith("adapter.")}
    got = same.export_adapter()
    assert got.keys() == live.keys() and all(torch.equal(v, live[k]) for k, v in got.items())
    for other in ({**base, **LORA, "model.lora.rank": 8}, base):
        policy = Policy(load_config(None, other), par=parallel1)
        with pytest.raises(checkpoint.CheckpointError, match="LoRA"):
            checkpoint.load(ckpt, policy)


def test_to_local_from_local_round_trip(tiny_qwen2):
    from tsync_mcore.model import bridge, lora
    spec = bridge.load_hf_config(tiny_qwen2)
    ls = lora.LoraSpec(3, 6.0, ("k_proj", "v_proj", "up_proj", "down_proj"))
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in lora.peft_shapes(spec, ls).items()}
    for tp in (1, 2):
        shards = [lora.to_local(full, spec, ls, tp, r) for r in range(tp)]
        back = lora.from_local(shards, spec, ls)
        assert list(back) == lora.peft_names(spec, ls)
        assert all(torch.equal(back[k], full[k]) for k in full)
    shards[1] = {k: v.clone() for k, v in shards[1].items()}
    shards[1]["decoder.layers.0.self_attention.linear_qkv.lora.A"] += 1
    with pytest.raises(ValueError, match="differs between TP ranks"):
        lora.from_local(shards, spec, ls)


@pytest.mark.parametrize("key,value,match", [
    ("model.lora.dropout", 0.1, "must be 0"),
    ("model.lora.targets", ["q_proj", "lm_head"], "non-empty list"),
    ("model.lora.targets", ["q_proj", "q_proj"], "twice"),
    ("model.lora.rank", -1, ">= 0"),
    ("model.lora.alpha", 0, "> 0"),
])
def test_lora_config_refused(key, value, match):
    from tsync_mcore.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=match):
        load_config(None, {key: value})


def _adapter_config(path, **kw) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
           "target_modules": ["q_proj", "v_proj"], **kw}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def test_lora_init_fills_model_lora(tmp_path):
    from tsync_mcore.config import ConfigError, load_config
    # the full module paths PEFT writes when it expanded 'all-linear'
    paths = [f"model.layers.{i}.{m}" for i in range(2)
             for m in ("self_attn.q_proj", "mlp.down_proj", "self_attn.o_proj")]
    d = _adapter_config(tmp_path / "a", r=16, lora_alpha=32, target_modules=paths,
                        use_rslora=True)
    cfg = load_config(None, {"model.lora_init": d})
    lc = cfg.model.lora
    assert (lc.rank, lc.alpha, lc.targets, lc.rslora) == (16, 32.0, ["q_proj", "o_proj",
                                                                     "down_proj"], True)
    assert any(c.startswith("model.lora: from model.lora_init") for c in cfg.choices)
    with pytest.raises(ConfigError, match="r = 16"):
        load_config(None, {"model.lora_init": d, "model.lora.rank": 8})
    bad = _adapter_config(tmp_path / "b", use_dora=True)
    with pytest.raises(ConfigError, match="model.lora_init.*adapter_config.json: use_dora"):
        load_config(None, {"model.lora_init": bad})
    with pytest.raises(ConfigError, match="adapter_config.json: missing"):
        load_config(None, {"model.lora_init": str(tmp_path / "none")})
