"""Megatron-Core model layer: HF <-> GPTModel conversion, TP=1 and TP=2 (2 gloo ranks)."""

from __future__ import annotations

import json
import os

from tests.helpers.paths import WORKERS

import pytest
import torch

from tests.helpers.dist_util import run_dist

WORKER = os.path.join(WORKERS, "model_worker.py")
FP32_TOL = 1e-5


def _hf_logits(hf_dir: str, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    with torch.no_grad():
        return hf(tokens).logits


def _tokens(vocab: int, b: int = 2, s: int = 23) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))


# --------------------------------------------------------------------------- TP=1, in process


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


# --------------------------------------------------------------------------- TP=2, 2 ranks


@pytest.fixture(scope="module")
def dist_results(tiny_ckpts, tmp_path_factory):
    """One 2-rank launch running all multi-rank checks (a launch costs ~8 s)."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    bad = make_tiny_checkpoint(str(tmp_path_factory.mktemp("bad_vocab")), vocab_size=255)
    cfg = {"tp2": {"ckpts": tiny_ckpts, "bad_vocab": bad}, "dp2": {"ckpt": tiny_ckpts["qwen2"]}}
    return run_dist([WORKER, json.dumps(cfg)], nproc=2, timeout=400)


def test_tp2_logits_match_hf(dist_results, tiny_ckpts):
    for r in dist_results:
        tp2 = r["tp2"]
        assert tp2["tp_size"] == 2 and tp2["tp_rank"] == r["rank"]
        for name in tiny_ckpts:
            assert tp2[name]["local_vocab"] == 128
            assert tp2[name]["logits_err"] <= FP32_TOL, (name, tp2[name])
        assert tp2["tp_streams_differ"] and tp2["dp_streams_equal"]


def test_tp2_export_grads_match_hf(dist_results, tiny_ckpts):
    """export_hf maps TP-sharded gradients like parameters (gathered, un-interleaved)."""
    for r in dist_results:
        for name in tiny_ckpts:
            assert r["tp2"][name]["grad_names_ok"], name
            assert r["tp2"][name]["grad_rel_err"] <= 1e-4, (name, r["tp2"][name])
            # pre-sync grads with tp_partial_grads=True == grads after finish_grad_sync
            assert r["tp2"][name]["raw_grads_equal_synced"], name


def test_tp2_export_round_trip(dist_results, tiny_ckpts):
    for r in dist_results:
        for name in tiny_ckpts:
            assert r["tp2"][name]["export_names_equal"], name
            assert r["tp2"][name]["export_exact"], name
        assert r["tp2"]["bf16_export_exact"]


def test_tp2_bad_vocab_error(dist_results):
    for r in dist_results:
        msg = r["tp2"]["bad_vocab_error"]
        assert msg is not None and "vocab_size 255" in msg and "tensor-parallel size 2" in msg


# --------------------------------------------------------------------------- DDP + optimizer, DP=2


@pytest.mark.parametrize("case", ["fp32_allreduce", "fp32_distopt", "bf16_distopt"])
def test_dp2_grad_sum_and_optimizer_step(dist_results, case):
    """Different sequences per rank; the reduced grads are the SUM of the ranks' grads."""
    for r in dist_results:
        assert r["dp2"]["dp_size"] == 2 and r["dp2"]["dp_rank"] == r["rank"]
        c = r["dp2"][case]
        assert c["grad_dtypes"] == ["torch.float32"]  # flat FP32 buffers, bf16 models too
        want = "torch.bfloat16" if case.startswith("bf16") else "torch.float32"
        assert c["param_dtypes"] == [want]
        assert c["flat_numel"] >= c["n_params"]
        assert c["sum_err"] == 0.0  # sum of the pre-sync buffers, not a mean
        if case.startswith("fp32"):
            # vs both sequences recomputed on one rank
            assert c["ref_err"] <= 1e-5 * c["ref_scale"]
            assert abs(c["grad_norm"] - c["ref_norm"]) <= 1e-5 * c["ref_norm"]
            assert c["adam_err"] <= 1e-6  # vs torch Adam + clip_grad_norm_ on summed grads
        else:
            assert c["ref_err"] <= 0.05 * c["ref_scale"]
            assert abs(c["grad_norm"] - c["ref_norm"]) <= 0.02 * c["ref_norm"]
        assert c["ok"] and c["changed"] and c["same_across_ranks"]
