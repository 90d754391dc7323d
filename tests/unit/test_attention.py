"""SDPAttention (local spec core attention through torch SDPA) against the Hugging Face model
and megatron's DotProductAttention: logits, gradients, K/V spans, FLOP-ledger mode."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from tsync_mcore.model import bridge, span
from tsync_mcore.model.attention import SDPAttention


def _tokens(vocab: int, b: int = 2, s: int = 23) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))


def _core(model):
    return model.decoder.layers[0].self_attention.core_attention


@pytest.mark.parametrize("name", ["qwen2", "qwen3_tied"])  # GQA 4/2; qk-norm, head_dim 32
def test_logits_and_grads_match_hf(parallel1, tiny_ckpts, name):
    from transformers import AutoModelForCausalLM

    model, spec = bridge.build_model(tiny_ckpts[name], attention="sdpa")
    assert type(_core(model)) is SDPAttention and bridge.attention_mode(model) == "causal"
    tokens = _tokens(spec.vocab_size)
    out = bridge.logits(model, tokens)
    out.float().logsumexp(-1).sum().backward()
    grads = bridge.export_hf({n: p.grad for n, p in model.named_parameters()}, spec)

    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpts[name], dtype=torch.float32)
    ref = hf(tokens).logits
    ref.logsumexp(-1).sum().backward()
    assert (out.detach() - ref.detach()).abs().max().item() <= 1e-5
    for n, p in hf.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-5), n


def test_same_as_megatron_attention_in_fp64(parallel1, tiny_qwen2):
    tokens = _tokens(256, s=31)
    m_sdpa, _ = bridge.build_model(tiny_qwen2, dtype=torch.float64, attention="sdpa")
    m_dpa, _ = bridge.build_model(tiny_qwen2, dtype=torch.float64, attention="megatron")
    assert bridge.attention_mode(m_dpa) == "full"
    with torch.no_grad():
        err = (bridge.logits(m_sdpa, tokens) - bridge.logits(m_dpa, tokens)).abs().max().item()
    assert err <= 1e-12  # same math, different kernels: only summation order differs


def test_span_after_context_equals_full_forward(parallel1, tiny_qwen2):
    """Causal aligned to the last key: a span after P context tokens sees keys 0..P+i."""
    model, spec = bridge.build_model(tiny_qwen2, dtype=torch.float64, attention="sdpa")
    ids = _tokens(spec.vocab_size, b=1, s=29)[0]
    with torch.no_grad():
        full = bridge.logits(model, ids[None])[0]
        _, kv = span.span_forward(model, ids[:17], 0, None)
        logits, _ = span.span_forward(model, ids[17:], 17, kv)
    assert (logits - full[17:]).abs().max().item() <= 1e-12


def test_streamed_span_gradient_with_sdpa(parallel1, tiny_ckpts):
    """Per-span backward + K/V-adjoint replay (OPD turns, shared prefixes) under SDPA."""
    from tests.helpers.span_shared import (
        FP32_FWD,
        FP32_GRAD,
        FP64_FWD,
        FP64_GRAD,
        NO_REPLAY_MIN,
        sw,
    )

    r = sw.check_model(tiny_ckpts["qwen3"], attention="sdpa")
    assert r["fwd_fp64"] <= FP64_FWD and r["fwd_fp32"] <= FP32_FWD, r
    assert r["grad_fp64"] <= FP64_GRAD and r["grad_fp32"] <= FP32_GRAD, r
    assert r["grad_no_replay"] > NO_REPLAY_MIN, r


def test_explicit_mask_is_honoured_and_bad_input_named(parallel1, tiny_qwen2):
    model, spec = bridge.build_model(tiny_qwen2, dtype=torch.float64, attention="sdpa")
    core = _core(model)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 1, 4, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(9, 1, 2, 16, dtype=torch.float64, generator=g) for _ in range(2))
    implicit = core(q, k, v, None)
    explicit = core(q, k, v, span.span_mask(5, 4))  # megatron bool mask, True = masked
    assert implicit.shape == (5, 1, 64)
    assert (implicit - explicit).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match="attention must be one of"):
        bridge.build_model(tiny_qwen2, attention="flash")
    with pytest.raises(ValueError, match="packed"):
        core(q, k, v, None, attention_bias=torch.zeros(1))


@pytest.mark.parametrize("name,offset", [("qwen2", 0), ("qwen2", 7), ("qwen3", 7)])
def test_span_sdpa_path_equals_megatron_attention_fp64(parallel1, tiny_ckpts, name, offset):
    """`sdpa_sbhd`, the span forward's core attention after context under Transformer Engine
    layers (TE's kernel takes sq == sk only), against megatron's DotProductAttention with the
    explicit span mask: outputs and q/k/v gradients, GQA (4 heads / 2 groups), FP64."""
    from tsync_mcore.model.attention import sdpa_sbhd

    model, spec = bridge.build_model(tiny_ckpts[name], dtype=torch.float64, attention="megatron")
    core = _core(model)
    assert type(core) is DotProductAttention
    n, hn = 6, spec.head_dim  # qwen3: head_dim 32 != hidden / heads: the scale follows hn
    g = torch.Generator().manual_seed(2)
    q = torch.randn(n, 1, spec.heads, hn, dtype=torch.float64, generator=g)
    k, v = (torch.randn(offset + n, 1, spec.kv_heads, hn, dtype=torch.float64, generator=g)
            for _ in range(2))
    w = torch.randn(n, 1, spec.heads * hn, dtype=torch.float64, generator=g)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        (out * w).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    assert span.softmax_scale(core, hn) == pytest.approx(hn ** -0.5, rel=1e-15)
    ref, ref_grads = run(lambda q, k, v: core(q, k, v, span.span_mask(n, offset)))
    out, grads = run(lambda q, k, v: sdpa_sbhd(q, k, v, hn ** -0.5, causal=True))
    assert (out - ref).abs().max().item() <= 1e-12
    assert all((a - b).abs().max().item() <= 1e-12 for a, b in zip(grads, ref_grads))
    # the span forward's own dispatch on the two local cores gives the same
    assert (span.span_attention(core, q, k, v, offset) - ref).abs().max().item() <= 1e-12
    m_sdpa, _ = bridge.build_model(tiny_ckpts[name], dtype=torch.float64, attention="sdpa")
    assert (span.span_attention(_core(m_sdpa), q, k, v, offset) - ref).abs().max().item() \
        <= 1e-12
