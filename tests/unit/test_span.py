"""K/V-span forward (tsync_mcore.model.span): exact logits and streamed gradients, TP=1/2, FLOPs.

The streamed gradient (per-span backward + reverse replay with the accumulated K/V adjoints)
is in tests/helpers/workers/span_worker.py, shared with the 2-rank launch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.span_shared import (
    FP32_FWD,
    FP32_GRAD,
    FP64_FWD,
    FP64_GRAD,
    NO_REPLAY_MIN,
    sw,
)


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "qwen2_tied"])
def test_exact_forward_and_streamed_grad_tp1(parallel1, tiny_ckpts, name):
    r = sw.check_model(tiny_ckpts[name])
    assert r["local_vocab"] == 256
    assert r["fwd_fp64"] <= FP64_FWD and r["fwd_fp32"] <= FP32_FWD, r
    assert r["grad_fp64"] <= FP64_GRAD and r["grad_fp32"] <= FP32_GRAD, r
    assert r["grad_no_replay"] > NO_REPLAY_MIN, r  # the check can fail


def test_kv_layout_and_helpers(parallel1, tiny_qwen3):
    from tsync_mcore.model import bridge, span

    model, spec = bridge.build_model(tiny_qwen3, dtype=torch.float64)
    tokens, _, _ = sw.problem(spec.vocab_size, 12, 1, torch.float64)
    logits, kv = span.span_forward(model, tokens[:5], 0, None)
    assert logits.shape == (5, spec.vocab_size) and logits.dtype == torch.float64
    assert len(kv) == spec.layers
    for x in kv:
        assert x.k.shape == x.v.shape == (5, 1, spec.kv_heads, spec.head_dim)
        assert x.k.is_contiguous() and x.v.is_contiguous() and x.k.requires_grad
    leaves = span.detached_leaves(kv)
    assert all(t.is_leaf and t.requires_grad for x in leaves for t in (x.k, x.v))
    assert span.kv_bytes(kv) == spec.layers * 2 * 5 * spec.kv_heads * spec.head_dim * 8
    _, kv2 = span.span_forward(model, tokens[5:], 5, leaves)
    both = span.concat_kv([kv, kv2])
    assert [len(x) for x in both] == [12] * spec.layers
    # the K/V of a span equal the K/V of the same positions in a one-shot forward
    _, whole = span.span_forward(model, tokens, 0, None)
    assert max((a.k - b.k).abs().max().item() for a, b in zip(both, whole)) < 1e-13
    # stop_after_kv and want_logits=False stop after the last layer's K/V: same K/V
    none, stopped = span.span_forward(model, tokens[5:], 5, leaves, stop_after_kv=True)
    none2, stopped2 = span.span_forward(model, tokens[5:], 5, leaves, want_logits=False)
    assert none is None and none2 is None
    for a, b, c in zip(kv2, stopped, stopped2):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(b.v, c.v)
    # DDP wrapper (`.module`) accepted
    wrapped = torch.nn.Module()
    wrapped.module = model
    assert torch.equal(span.span_forward(wrapped, tokens[:5], 0, None)[0], logits)


def test_shared_prefix_two_continuations(parallel1, tiny_qwen2):
    """GRPO: one prompt forward, two continuations against its leaves, then the prompt's
    retained graph backpropagated once with the summed adjoint == two full backwards."""
    from tsync_mcore.model import bridge, span

    model, spec = bridge.build_model(tiny_qwen2, dtype=torch.float64)
    prompt, _, _ = sw.problem(spec.vocab_size, 9, 2, torch.float64)
    seqs = [torch.cat([prompt, sw.problem(spec.vocab_size, n, 3 + n, torch.float64)[0]])
            for n in (6, 11)]  # fmt: skip
    losses = [sw.problem(spec.vocab_size, len(s), 7 + len(s), torch.float64) for s in seqs]
    # reference: each full sequence, loss on the continuation tokens only
    model.zero_grad(set_to_none=True)
    for s, (_, tgt, coef) in zip(seqs, losses):
        lp = sw.token_logp(bridge.logits(model, s[None])[0], tgt)
        (coef[len(prompt):] * lp[len(prompt):]).sum().backward()
    ref = sw._grads(model)

    _, prompt_kv = span.span_forward(model, prompt, 0, None, want_logits=False)
    leaves = span.detached_leaves(prompt_kv)
    for s, (_, tgt, coef) in zip(seqs, losses):
        n0 = len(prompt)
        logits, _ = span.span_forward(model, s[n0:], n0, leaves)
        (coef[n0:] * sw.token_logp(logits, tgt[n0:])).sum().backward()
    torch.autograd.backward(
        [t for x in prompt_kv for t in (x.k, x.v)], [t.grad for x in leaves for t in (x.k, x.v)]
    )
    assert sw.rel_l2(sw._grads(model), ref) <= FP64_GRAD


def test_bad_inputs(parallel1, tiny_llama):
    from tsync_mcore.model import bridge, span

    model, _ = bridge.build_model(tiny_llama)
    tokens = torch.arange(10)
    _, kv = span.span_forward(model, tokens[:4], 0, None)
    with pytest.raises(ValueError, match="past is None"):
        span.span_forward(model, tokens[4:], 4, None)
    with pytest.raises(ValueError, match="past must hold"):
        span.span_forward(model, tokens[4:], 5, kv)
    with pytest.raises(ValueError, match="1-D"):
        span.span_forward(model, tokens[None], 0, None)
    with pytest.raises(TypeError, match="GPTModel"):
        span.span_forward(torch.nn.Linear(2, 2), tokens, 0, None)
    model.config.attention_dropout = 0.1
    try:
        with pytest.raises(ValueError, match="dropout"):
            span.span_forward(model, tokens, 0, None)
    finally:
        model.config.attention_dropout = 0.0


def test_flops_streamed_vs_plain(parallel1, tiny_qwen2):
    """20 turns x 16 tokens, 2 layers: streamed (turns + replay) / plain forward+backward.

    Megatron's plain forward computes the full S x S score matrix (masked), which flatters
    the span version's count; the replay skips the last turn and stops after the last K/V.
    """
    from tsync_mcore.model import bridge

    model, spec = bridge.build_model(tiny_qwen2)
    assert spec.layers == 2
    turns, per_turn = 20, 16
    bounds = [i * per_turn for i in range(turns + 1)]
    tokens, targets, coef = sw.problem(spec.vocab_size, bounds[-1], 4, torch.float32)
    plain, turn, replay = (FlopCounterMode(display=False) for _ in range(3))
    with plain:
        sw.full_grads(model, tokens, targets, coef)
    counters = {"turns": turn, "replay": replay}
    sw.streamed_grads(model, tokens, targets, coef, bounds, phase=counters.get)
    ratio = (turn.get_total_flops() + replay.get_total_flops()) / plain.get_total_flops()
    replay_share = replay.get_total_flops() / plain.get_total_flops()
    print(f"streamed/plain FLOPs {ratio:.3f}, replay/plain {replay_share:.3f}")
    assert ratio <= 2.2 and replay_share <= 0.55
