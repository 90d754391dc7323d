"""K/V-span forward on Transformer Engine layers (GPU with transformer_engine only; CI has
neither: the module skips with the reason). TE fuses the input / pre-MLP norms into its QKV /
fc1 linears and its core attention runs sq == sk; a span after context goes through SDPA with
the causal diagonal at the last key (model/span.py). Checked: the spans' logits against the
whole-sequence TE forward and against the local spec's FP64 forward on the same checkpoint,
and the streamed gradient (per-span backward + K/V-adjoint replay) against the full one.

On a GPU node with TE: python -m pytest -q tests/test_span_te.py
"""

from __future__ import annotations

import pytest
import torch


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (CI has none)"
    from tsync_mcore.model.bridge.build import _te_available

    if not _te_available():
        return "needs an importable transformer_engine (pip install transformer_engine[pytorch])"
    return None


_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

# TE may run fp32 GEMMs in TF32 (~1e-3 relative) and its fp32 attention is its unfused kernel,
# so span and full forwards differ by rounding only; a wrong mask or softmax scale in the
# span's attention moves logits by 1e-1 or more, and the gradient without the replay is
# 50-65 % off (measured on the local spec: fp32 1e-6 / bf16 9e-3 streamed vs full).
FP32_SAME_MODEL = 5e-3  # spans vs the whole-sequence TE forward (logits abs, grads rel L2)
FP32_VS_LOCAL = 2e-2  # TE spans vs the local spec in FP64 (logits abs)
BF16_GRAD = 5e-2  # rel L2 of the streamed bf16 gradient vs the full bf16 one
NO_REPLAY_MIN = 1e-1


def _te_model(path: str, dtype: torch.dtype):
    from tsync_mcore.model import bridge, span

    model, spec = bridge.build_model(path, dtype=dtype, spec="te")
    core = model.decoder.layers[0].self_attention.core_attention
    assert span._is_te_attention(core), type(core)
    assert span.softmax_scale(core, spec.head_dim) == pytest.approx(spec.head_dim ** -0.5)
    assert type(model.decoder.layers[0].input_layernorm).__name__ == "IdentityOp"
    return model, spec


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen2_tied"])
def test_te_spans_equal_full_forward(parallel1, tiny_ckpts, name):
    from tests.helpers.span_shared import sw
    from tsync_mcore.model import bridge

    model, spec = _te_model(tiny_ckpts[name], torch.float32)
    tokens, _, _ = sw.problem(spec.vocab_size, sw.BOUNDS[-1], 0, torch.float32)
    tokens = tokens.cuda()
    err, _ = sw.forward_err(model, tokens, sw.BOUNDS)
    assert err <= FP32_SAME_MODEL, err
    # an independent implementation: megatron's local spec, FP64, whole sequence
    ref_model, _ = bridge.build_model(tiny_ckpts[name], dtype=torch.float64, spec="local",
                                      attention="megatron")
    with torch.no_grad():
        ref = bridge.logits(ref_model, tokens[None])[0]
        parts, outs = [], []
        for a, b in zip(sw.BOUNDS, sw.BOUNDS[1:]):
            logits, kv = sw.span_forward(model, tokens[a:b], a,
                                         sw.concat_kv(parts) if parts else None)
            parts.append(kv)
            outs.append(logits)
    assert (torch.cat(outs).double() - ref).abs().max().item() <= FP32_VS_LOCAL


@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_SAME_MODEL),
                                       (torch.bfloat16, BF16_GRAD)], ids=["fp32", "bf16"])
def test_te_streamed_gradient(parallel1, tiny_qwen3, dtype, tol):
    from tests.helpers.span_shared import sw

    model, spec = _te_model(tiny_qwen3, dtype)
    tokens, targets, coef = (t.cuda() for t in sw.problem(spec.vocab_size, sw.BOUNDS[-1], 0,
                                                          dtype))
    ref = sw.full_grads(model, tokens, targets, coef)
    streamed = sw.streamed_grads(model, tokens, targets, coef, sw.BOUNDS)
    assert sw.rel_l2(streamed, ref) <= tol
    no_replay = sw.streamed_grads(model, tokens, targets, coef, sw.BOUNDS, replay=False)
    assert sw.rel_l2(no_replay, ref) > NO_REPLAY_MIN
