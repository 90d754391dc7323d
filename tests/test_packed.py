"""Packed serving (docs/learner.md, "Packed serving").

1. `model/packed.py`: a packed forward of several segments (some with past K/V) against
   separate `span_forward` calls, FP64: logits, K/V, parameter gradients and the adjoints on
   the past leaves, for every attention path that runs on CPU.
2. The learner: packed vs one-by-one service gives the same update (FP32 ≤ 1e-6) for GRPO
   (with and without shared prompts) and OPD under every schedule; what packs and what
   stays one by one; the budget's edge cases; the trace's pass ids and times.
"""

from __future__ import annotations

import pytest
import torch

from tsync_mcore.model import bridge
from tsync_mcore.model.packed import Segment, block_mask, lm_head, packed_forward
from tsync_mcore.model.span import KV, detached_leaves, span_forward

FP64 = 1e-12


def _params_grad(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _segments(vocab: int, model, gen) -> list[tuple[torch.Tensor, int, list[KV] | None]]:
    """(tokens, offset, past K/V or None): segments without and with context, one token long."""
    out = []
    for n, p in ((7, 0), (9, 5), (4, 0), (1, 3), (6, 11)):
        toks = torch.randint(0, vocab, (n,), generator=gen)
        past = None
        if p:
            with torch.no_grad():
                ctx = torch.randint(0, vocab, (p,), generator=gen)
                _, past = span_forward(model, ctx, 0, None, want_logits=False)
        out.append((toks, p, past))
    return out


def _leaves(past):
    return None if past is None else detached_leaves(past)


@pytest.mark.parametrize("name,attention,path", [
    ("qwen2", "megatron", "segments"), ("qwen2", "megatron", "block"),
    ("qwen2", "sdpa", "segments"), ("qwen2", "sdpa", "block"), ("qwen2", "sdpa", "auto"),
    ("qwen3", "megatron", "segments"), ("qwen2_tied", "megatron", "block")])
def test_packed_forward_equals_separate_spans_fp64(parallel1, tiny_ckpts, name, attention, path):
    model, spec = bridge.build_model(tiny_ckpts[name], dtype=torch.float64, attention=attention)
    gen = torch.Generator().manual_seed(3)
    segs = _segments(spec.vocab_size, model, gen)
    coefs = [torch.randn(len(t), spec.vocab_size, generator=gen, dtype=torch.float64)
             for t, _, _ in segs]

    # One by one: span_forward per segment, each loss backpropagated on its own.
    ref_logits, ref_kv, ref_adj = [], [], []
    model.zero_grad(set_to_none=True)
    for (toks, p, past), c in zip(segs, coefs):
        leaves = _leaves(past)
        logits, kv = span_forward(model, toks, p, leaves)
        kv_coef = sum((x.k * 0.1 + x.v * 0.2).sum() for x in kv)  # K/V feed later spans
        ((logits * c).sum() + kv_coef).backward()
        ref_logits.append(logits.detach())
        ref_kv.append([KV(x.k.detach(), x.v.detach()) for x in kv])
        ref_adj.append(None if leaves is None else [(x.k.grad, x.v.grad) for x in leaves])
    ref_grad = _params_grad(model)

    # Packed: one forward, one backward of the summed losses.
    leaves = [_leaves(past) for _, _, past in segs]
    out = packed_forward(model, [Segment(t, p, lv) for (t, p, _), lv in zip(segs, leaves)],
                         attention=path)
    logits = lm_head(model, out.hidden)
    loss = 0
    for i, c in enumerate(coefs):
        loss = loss + (logits[out.rows(i)] * c).sum()
        loss = loss + sum((x.k * 0.1 + x.v * 0.2).sum() for x in out.kv[i])
    loss.backward()
    grad = _params_grad(model)

    for i in range(len(segs)):
        assert (logits[out.rows(i)] - ref_logits[i]).abs().max() <= FP64, i
        for a, b in zip(out.kv[i], ref_kv[i]):
            assert a.k.shape == b.k.shape and a.k.requires_grad
            assert (a.k - b.k).abs().max() <= FP64 and (a.v - b.v).abs().max() <= FP64, i
        if leaves[i] is not None:
            for x, (gk, gv) in zip(leaves[i], ref_adj[i]):
                assert (x.k.grad - gk).abs().max() <= FP64 and (x.v.grad - gv).abs().max() <= FP64
    assert set(grad) == set(ref_grad)
    for n in grad:
        scale = max(1.0, ref_grad[n].abs().max().item())
        assert (grad[n] - ref_grad[n]).abs().max() <= FP64 * scale, n


def test_stop_after_kv_and_errors(parallel1, tiny_qwen2):
    model, spec = bridge.build_model(tiny_qwen2, dtype=torch.float64)
    a, b = torch.arange(5), torch.arange(5, 12)
    out = packed_forward(model, [Segment(a, 0), Segment(b, 0)], stop_after_kv=True)
    assert out.hidden is None and [len(kv[0]) for kv in out.kv] == [5, 7]
    _, kv_b = span_forward(model, b, 0, None, stop_after_kv=True)
    assert all(torch.equal(x.k, y.k) for x, y in zip(out.kv[1], kv_b)) or \
        max((x.k - y.k).abs().max().item() for x, y in zip(out.kv[1], kv_b)) <= FP64
    with pytest.raises(ValueError, match="segment 1: past is None but offset is 3"):
        packed_forward(model, [Segment(a, 0), Segment(b, 3)])
    with pytest.raises(ValueError, match="segment 0: tokens must be a non-empty"):
        packed_forward(model, [Segment(a[:0], 0)])
    with pytest.raises(ValueError, match="'varlen' needs CUDA"):
        packed_forward(model, [Segment(a, 0)], attention="varlen")


def test_block_mask_layout():
    m = block_mask([2, 1], [1, 2])[0, 0]
    # keys: [p1, a0, a1, p2, p2', b0]; True = masked
    assert m.tolist() == [[False, False, True, True, True, True],
                          [False, False, False, True, True, True],
                          [True, True, True, False, False, False]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention needs CUDA")
def test_varlen_path_matches_segments_on_gpu(tiny_qwen2):
    from tsync_mcore.model.parallel import init_parallel
    init_parallel(tp_size=1)
    model, spec = bridge.build_model(tiny_qwen2, dtype=torch.bfloat16, attention="sdpa")
    gen = torch.Generator().manual_seed(5)
    segs = _segments(spec.vocab_size, model, gen)  # on the CPU, then moved over
    model = model.cuda()
    segs = [(t.cuda(), p, None if past is None else [KV(x.k.cuda(), x.v.cuda()) for x in past])
            for t, p, past in segs]
    with torch.no_grad():
        a = packed_forward(model, [Segment(*s) for s in segs], attention="segments")
        b = packed_forward(model, [Segment(*s) for s in segs], attention="varlen")
    assert (a.hidden.float() - b.hidden.float()).abs().max() < 5e-2
