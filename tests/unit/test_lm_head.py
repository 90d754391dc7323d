"""The fused LM head + scored log-prob (tsync_mcore/kernels/lm_head.py) against a plain
FP64 reference (full logits, log_softmax, gather, autograd): log-probs, entropy and the
gradients w.r.t. the hidden states and the weight, at TP = 1 and TP = 2 (gloo ranks); the
model side (bridge/span hand over final hidden states and the output weight, tied or not)
and the learner's update with the head on and off.

The Triton interpreter's run of the same kernel is in tests/kernel_checks.py (numerics).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.lm_head_shared import TOL, err, fused, hw, reference
from tsync_mcore.kernels import fused_lm_head_logprob, lm_head


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 10, 37, 1024])  # 10 does not divide T = 37
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_fp64_reference(dtype, chunk, with_entropy):
    hidden, weight, targets, grad = hw.problem(dtype)
    grad_ent = grad.flip(0) if with_entropy else None
    logp, ent, gh, gw = fused(hidden, weight, targets, grad, chunk, grad_ent)
    assert logp.dtype == ent.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ref = reference(hidden, weight, targets, grad, grad_ent)
    for name, got, want in zip(("logp", "entropy", "grad_h", "grad_w"), (logp, ent, gh, gw), ref):
        e = err(got, want)
        print(f"{dtype} chunk {chunk} entropy grad {with_entropy} {name}: {e:.1e}")
        assert e <= TOL[dtype], (name, e)


def test_without_entropy_and_weight_frozen():
    hidden, weight, targets, grad = hw.problem(torch.float64)
    h = hidden.clone().requires_grad_()
    logp = fused_lm_head_logprob(h, weight, targets, chunk=7)  # the weight needs no grad
    (logp * grad).sum().backward()
    ref = reference(hidden, weight, targets, grad)
    assert err(logp, ref[0]) <= 1e-12 and err(h.grad, ref[2]) <= 1e-12


def test_edge_cases_stay_finite():
    # Logits in the thousands (no overflow: everything is relative to the row max), targets
    # at the vocab's edges and far below the max, an out-of-vocab target (−lse, as
    # scored_logprob), and no tokens at all.
    gen = torch.Generator().manual_seed(3)
    hidden = 40.0 * torch.randn(9, 8, generator=gen, dtype=torch.float64)
    weight = 30.0 * torch.randn(50, 8, generator=gen, dtype=torch.float64)
    targets = torch.tensor([0, 49, 3, 7, 11, 20, 30, 40, 45])
    grad = torch.ones(9, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        logp, ent, gh, gw = fused(hidden.to(dtype), weight.to(dtype), targets, grad.to(dtype), 4)
        assert all(torch.isfinite(t).all() for t in (logp, ent, gh, gw))
        assert logp.min() < -1000  # a target far below its row's max is scored, not -inf
        ref = reference(hidden, weight, targets, grad)
        assert err(logp, ref[0]) <= TOL[dtype] and err(gh, ref[2]) <= TOL[dtype]
    outside = torch.tensor([50])
    lp = fused_lm_head_logprob(hidden[:1], weight, outside)
    assert torch.allclose(lp, -torch.logsumexp(hidden[:1] @ weight.t(), -1), atol=1e-12, rtol=0)
    h0 = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    w0 = weight.clone().requires_grad_()
    lp0 = fused_lm_head_logprob(h0, w0, torch.zeros(0, dtype=torch.long))
    lp0.sum().backward()
    assert lp0.shape == (0,) and torch.count_nonzero(w0.grad) == 0


def test_bad_inputs_rejected():
    h, w, t = torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk"):
        fused_lm_head_logprob(h, w, t, chunk=0)
    with pytest.raises(ValueError, match="targets"):
        fused_lm_head_logprob(h, w, t[:3])
    with pytest.raises(ValueError, match="V_local, H"):
        fused_lm_head_logprob(h, torch.zeros(10, 7), t)
    with pytest.raises(TypeError, match="bfloat16"):
        fused_lm_head_logprob(h, w.bfloat16(), t)


def test_bf16_close_to_fp32_and_fp32_weight_grad_accumulator():
    hidden, weight, targets, grad = hw.problem(torch.float32)
    ref = fused(hidden, weight, targets, grad, 10)
    got = fused(hidden.bfloat16(), weight.bfloat16(), targets, grad.bfloat16(), 10)
    assert got[0].dtype == torch.float32 and got[3].dtype == torch.bfloat16
    for a, b in zip(got, ref):
        assert err(a.float(), b.double()) <= 0.05


def test_config_keys_checked():
    from tsync_mcore.config import ConfigError, load_config
    cfg = load_config(None, {})
    assert cfg.learner.fused_lm_head is True and cfg.learner.lm_head_chunk == 1024
    for bad in (0, -4):
        with pytest.raises(ConfigError, match="'learner.lm_head_chunk'.*must be > 0"):
            load_config(None, {"learner.lm_head_chunk": bad})
    with pytest.raises(ConfigError, match="'learner.fused_lm_head'"):
        load_config(None, {"learner.fused_lm_head": "yes"})


def test_peak_bytes_estimate():
    # Qwen2.5-1.5B shapes, bf16, one rank, a 32k-token source: the fused head's estimate is
    # a small fraction of the unfused logits and their gradient.
    t, h, v = 32768, 1536, 151936
    fused_b = lm_head.peak_bytes(t, h, v, 1024, torch.bfloat16)
    assert fused_b == 2 * 1024 * v * 2 + t * h * 2 + v * h * 4 + v * h * 2 + 4 * t * 4
    assert lm_head.unfused_peak_bytes(t, t, v, torch.bfloat16) == 4 * t * v * 2
    assert fused_b < lm_head.unfused_peak_bytes(t, t, v, torch.bfloat16) / 15
    assert lm_head.peak_bytes(5, 8, 10, 1024, torch.float32) == 2 * 5 * 10 * 4 + 5 * 8 * 4 \
        + 10 * 8 * 4 + 4 * 5 * 4  # chunk capped at T; no separate product for fp32


def _policy(hf_dir, par, fused, chunk=5):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    return Policy(load_config(None, {"model.hf_dir": hf_dir, "learner.fused_lm_head": fused,
                                     "learner.lm_head_chunk": chunk}), par=par)


@pytest.mark.parametrize("ckpt", ["qwen2", "qwen2_tied"])
def test_policy_grads_fused_equal_unfused(tiny_ckpts, parallel1, ckpt):
    """Sources (full sequence) and a span against a prompt's K/V: the same log-probs, and the
    same gradient in the DDP buffers (main_grad of the output weight, or of the tied
    embedding), with the head on and off."""
    from tests.helpers.batchgen import make_batch
    from tsync_mcore.model import bridge, span
    rows = make_batch(256, n_groups=2, m=2, seed=4)
    out = {}
    for fused in (True, False):
        policy = _policy(tiny_ckpts[ckpt], parallel1, fused)
        tied = bridge.unwrap(policy.model).share_embeddings_and_output_weights
        assert tied == ckpt.endswith("tied")
        sums = [policy.backward_source(r["tokens"], r["scored_mask"], 0.7) for r in rows]
        assert all(isinstance(s, torch.Tensor) and s.dim() == 0 for s in sums)
        # a continuation against a detached prompt: logits or hidden from the span forward
        r = rows[0]
        ids = torch.tensor(r["tokens"])
        _, kv = policy.span_forward(ids[:6], 0, None, want_logits=False)
        res, _ = policy.span_forward(ids[6:], 6, span.detached_leaves(kv, requires_grad=False))
        assert isinstance(res, bridge.HeadInput) == fused
        pos = policy.positions(r["scored_mask"][6:])
        policy.scored_logprob(res, ids[6:], pos).sum().backward()
        out[fused] = (torch.stack(sums), [b.clone() for b in policy.grad_buffers()],
                      policy.take_entropy(), policy.take_head_peak())
        policy.zero_grads()
    (s1, g1, e1, p1), (s0, g0, e0, p0) = out[True], out[False]
    assert torch.allclose(s1, s0, rtol=0, atol=1e-5)
    num = sum(float((a - b).double().norm() ** 2) for a, b in zip(g1, g0)) ** 0.5
    den = sum(float(b.double().norm() ** 2) for b in g0) ** 0.5
    print(f"{ckpt}: fused vs unfused grad rel L2 {num / den:.1e}")
    assert den > 0 and num / den <= 1e-6
    assert e1[1] == e0[1] and abs(e1[0] - e0[0]) <= 1e-4 * e0[1]
    assert p1 > 0 and p0 > 0  # estimates reported either way (tiny sizes: the fused one's


def test_final_hidden_times_weight_is_the_logits(tiny_ckpts, parallel1):
    from tsync_mcore.model import bridge
    for ckpt in ("qwen3", "qwen2_tied"):
        policy = _policy(tiny_ckpts[ckpt], parallel1, True)
        tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            head = bridge.final_hidden(policy.model, tokens)
            logits = bridge.logits(policy.model, tokens)
        assert head.hidden.shape == (2, 11, policy.spec.hidden)
        assert torch.allclose(head.hidden @ head.weight.t(), logits, rtol=0, atol=1e-5)
        assert bridge.unwrap(policy.model).post_process  # restored


def test_ledger_counts_the_fused_head_as_it_runs(tiny_qwen2, parallel1):
    """FlopCounterMode over one source served by the Policy, head on and off, against the
    ledger's account of its trace record: the fused head projects only the scored positions
    (model FLOPs) and recomputes their logits in backward (recompute, not credited)."""
    from torch.utils.flop_counter import FlopCounterMode

    from tsync_mcore.observability.ledger.account import update_flops
    from tsync_mcore.observability.trace import SourceRecord
    tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    mask = [0] * 10 + [1] * 12 + [0] * 8
    for fused in (True, False):
        policy = _policy(tiny_qwen2, parallel1, fused)
        with FlopCounterMode(display=False) as fc:
            policy.backward_source(tokens, mask, 1.0)
        policy.zero_grads()
        rec = SourceRecord(update=0, rank=0, source="trajectory", traj_id="t", group_id="g",
                           turn=None, policy_version=0, scored_tokens=12, ready=0.0,
                           start=0.0, end=1.0, span_tokens=30, logits=True, fused_head=fused)
        work = update_flops(policy.spec, [rec], attention=policy.attention_mode)
        vocab = 2 * policy.spec.hidden * policy.spec.vocab_size
        assert work.recompute_flops == (12 * vocab if fused else 0)
        assert work.by_component["vocab_proj"]["forward"] == (12 if fused else 30) * vocab
        assert work.total + work.recompute_flops == fc.get_total_flops()
