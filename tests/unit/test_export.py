"""`python -m tsync_mcore.learner.export`: a run's checkpoint as a Hugging Face directory.

Checkpoints come from real short training runs (tests/helpers/workers/export_worker.py): TP=1 in
this process, TP=2 under torchrun. The reference for the export is the learner itself: its
Megatron forward's logits on probe tokens and its live HF-named parameters, both taken
before the checkpoint was read back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers.batchgen import write_batches
from tests.helpers.export_shared import (  # noqa: F401  (fixtures)
    check_against_learner,
    export_run,
    exported_tensors,
    tp1_run,
    vllm_tiny,
)
from tests.helpers.workers.export_worker import PROBE, train  # noqa: E402


def test_tp1_export_loads_in_transformers_with_the_learners_logits(tp1_run, tmp_path, capsys):
    out, sharded = str(tmp_path / "hf"), str(tmp_path / "hf_sharded")
    assert export_run(tp1_run, out) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["version"], summary["tp"], summary["dtype"]) == (2, 1, "float32")
    assert sorted(os.listdir(out)) == ["chat_template.jinja", "config.json",
                                       "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["dtype"] == "float32" and cfg["model_type"] == "qwen2"
    err = check_against_learner(tp1_run, out)
    print(f"\nTP=1 export: HF FP32 logits vs the learner's Megatron logits max |err| {err:.1e}")
    # sharded, as save_pretrained shards, and the same model
    assert export_run(tp1_run, sharded, "--max-shard-size", "40KB", "--step", "2") == 0
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    check_against_learner(tp1_run, sharded)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("The quick brown fox") == AutoTokenizer.from_pretrained(
        yaml.safe_load(open(os.path.join(tp1_run, "config.yaml")))["model"]["hf_dir"]
    ).encode("The quick brown fox")


def test_bf16_run_exports_bf16(tiny_llama, parallel1, tmp_path):
    """model.dtype bf16: the export keeps it (weights and config.json), bit for bit the
    learner's bf16 parameters, and transformers runs it in bf16."""
    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, 256, n_updates=2, seed=7)
    run = str(tmp_path / "run")
    train(tiny_llama, batch, run, tp=1, updates=2, par=parallel1, dtype="bf16")
    out = str(tmp_path / "hf")
    assert export_run(run, out) == 0
    ref = load_file(os.path.join(run, "learner_final.safetensors"))
    got = exported_tensors(out)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, ref[f"param.{k}"])
               for k, t in got.items())
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE)).logits.float()
    scale = float(ref["logits"].abs().max())
    assert float((logits - ref["logits"]).abs().max()) <= 0.05 * scale  # bf16 arithmetic


def _rank0(run: str) -> str:
    return os.path.join(run, "checkpoints", "step_2", "rank0.safetensors")


def _rewrite(run: str, edit) -> None:
    """Edit rank 0's tensors and write its digest to match (whoever can write one can write
    the other)."""
    path = _rank0(run)
    with safe_open(path, "pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    edit(tensors)
    save_file(tensors, path, metadata=header)
    with open(path.removesuffix(".safetensors") + ".sha256", "w") as f:
        f.write(hashlib.sha256(open(path, "rb").read()).hexdigest())


def _flip_bytes(run):
    with open(_rank0(run), "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)


def _nan(t):
    t["model.decoder.final_layernorm.weight"][0] = float("nan")


def _shape(t):
    k = "model.decoder.layers.0.mlp.linear_fc2.weight"
    t[k] = t[k][:, :-1].clone()


def _missing(t):
    del t["model.decoder.layers.1.self_attention.linear_qkv.bias"]


def _config(run, **model):
    path = os.path.join(run, "config.yaml")
    cfg = yaml.safe_load(open(path))
    cfg["model"].update(model)
    yaml.safe_dump(cfg, open(path, "w"))


def _meta(run):
    path = os.path.join(run, "checkpoints", "step_2", "meta.json")
    meta = json.load(open(path))
    json.dump(dict(meta, tp=2, world_size=2), open(path, "w"))


CASES = {  # name: (edit of the run copy, extra CLI flags, what the one line must say)
    "digest": (_flip_bytes, [], "rank0.safetensors: contents do not match"),
    "non_finite": (lambda r: _rewrite(r, _nan), [], "final_layernorm.weight' holds non-finite"),
    "wrong_shape": (lambda r: _rewrite(r, _shape), [], "linear_fc2.weight' is (64, 127)"),
    "missing_tensor": (lambda r: _rewrite(r, _missing), [], "no model tensor for "
                       "model.layers.1.self_attn.q_proj.bias"),
    "wrong_dtype": (lambda r: _config(r, dtype="bf16"), [], "torch.float32; this model"),
    "meta_layout": (_meta, [], "header world_size='1', meta.json/this run says '2'"),
    "missing_step": (None, ["--step", "9"], "no checkpoint step_9 (have: step_2)"),
    "latest_traversal": (lambda r: open(os.path.join(r, "checkpoints", "latest"), "w")
                         .write("../../etc"), [], "is not a step_N name"),
    "not_a_run": (lambda r: os.remove(os.path.join(r, "config.yaml")), [],
                  "no config.yaml (not a run directory"),
    "hf_dir_gone": (lambda r: _config(r, hf_dir=r + "/nowhere"), [], "nowhere: missing"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_input_is_one_line_and_writes_nothing(tp1_run, tmp_path, capsys, case):
    edit, flags, says = CASES[case]
    run = str(tmp_path / "run")
    shutil.copytree(tp1_run, run)
    if edit is not None:
        edit(run)
    out = str(tmp_path / "out" / "hf")
    capsys.readouterr()
    assert export_run(run, out, *flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: export: ") and says in err, err
    assert not os.path.exists(os.path.dirname(out))  # not even its parent
