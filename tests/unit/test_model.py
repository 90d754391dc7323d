"""Megatron-Core model layer: HF <-> GPTModel conversion, TP=1 and TP=2 (2 gloo ranks)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tests.helpers.model_shared import FP32_TOL


def _hf_logits(hf_dir: str, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    with torch.no_grad():
        return hf(tokens).logits


def _tokens(vocab: int, b: int = 2, s: int = 23) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))


ALL_VARIANTS = ["qwen2", "llama", "qwen3", "qwen2_tied", "llama_tied", "qwen3_tied"]


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_logits_match_hf_tp1(parallel1, tiny_ckpts, name):
    from tsync_mcore.model import bridge

    model, spec = bridge.build_model(tiny_ckpts[name])
    assert spec.tie == name.endswith("_tied")
    tokens = _tokens(spec.vocab_size)
    with torch.no_grad():
        out = bridge.logits(model, tokens)
    assert out.shape == (2, 23, spec.vocab_size)  # batch-first
    ref = _hf_logits(tiny_ckpts[name], tokens)
    assert ref.abs().max() > 0.5  # random weights large enough that logits are not flat
    assert (out - ref).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("name", ["qwen2", "llama_tied", "qwen3"])
def test_export_round_trip_tp1(parallel1, tiny_ckpts, name):
    from tsync_mcore.model import bridge

    model, spec = bridge.build_model(tiny_ckpts[name])
    original = bridge.load_hf_state_dict(tiny_ckpts[name])
    exported = bridge.export_hf_state_dict(model, spec)
    assert list(exported) == bridge.hf_param_names(spec)
    assert sorted(exported) == sorted(original)
    assert ("lm_head.weight" in exported) == (not spec.tie)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k
        assert exported[k].is_contiguous() and exported[k].device.type == "cpu"


def test_export_accepts_ddp_prefix_and_grads(parallel1, tiny_qwen2):
    """Same mapping for 'module.'-prefixed names and for gradient tensors."""
    from tsync_mcore.model import bridge

    model, spec = bridge.build_model(tiny_qwen2)
    tokens = _tokens(spec.vocab_size)
    bridge.logits(model, tokens).float().logsumexp(-1).sum().backward()
    grads = {f"module.{n}": p.grad for n, p in model.named_parameters()}
    hf_grads = bridge.export_hf(grads, spec)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    hf(tokens).logits.logsumexp(-1).sum().backward()
    for n, p in hf.named_parameters():
        assert torch.allclose(hf_grads[n], p.grad, rtol=1e-4, atol=1e-5), n


def test_fp64_and_bf16_build(parallel1, tiny_qwen3):
    from tsync_mcore.model import bridge

    tokens = _tokens(256)
    m64, spec = bridge.build_model(tiny_qwen3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in m64.parameters())
    with torch.no_grad():
        ref64 = _hf_logits(tiny_qwen3, tokens, torch.float64)
        err64 = (bridge.logits(m64, tokens) - ref64).abs().max()
    # both Megatron and HF compute RoPE cos/sin in fp32 (differently): ~5e-7, not 1e-15
    assert err64.item() < 2e-6
    m16, _ = bridge.build_model(tiny_qwen3, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    assert m16.config.bf16 and m16.config.params_dtype == torch.bfloat16
    with torch.no_grad():
        out16 = bridge.logits(m16, tokens)
    assert out16.dtype == torch.bfloat16
    assert (out16.float() - _hf_logits(tiny_qwen3, tokens)).abs().max().item() < 0.2


def test_spec_and_bad_inputs(parallel1, tiny_qwen2, tmp_path):
    from tsync_mcore.model import bridge

    spec = bridge.load_hf_config(tiny_qwen2)
    assert (spec.arch, spec.vocab_size, spec.hidden, spec.layers) == ("qwen2", 256, 64, 2)
    assert (spec.heads, spec.kv_heads, spec.head_dim, spec.ffn) == (4, 2, 16, 128)
    assert (spec.rope_theta, spec.rms_eps, spec.qkv_bias, spec.qk_norm) == (1e6, 1e-6, True, False)
    with pytest.raises(ValueError, match="spec must be"):
        bridge.build_model(tiny_qwen2, spec="nope")
    with pytest.raises(KeyError, match="no HF mapping"):
        bridge.export_hf({"decoder.layers.0.bogus.weight": torch.zeros(1)}, spec)
    cfg = json.load(open(os.path.join(tiny_qwen2, "config.json")))
    with pytest.raises(ValueError, match="unsupported model_type"):
        bridge.ModelSpec.from_hf_config({**cfg, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type"):
        bridge.ModelSpec.from_hf_config({**cfg, "rope_parameters": {"rope_type": "yarn"}})
