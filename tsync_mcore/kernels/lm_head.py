"""Fused LM head + scored log-prob: log π(a_t) from final hidden states, never the [T, V] logits.

logp_t = (h_t · w_{a_t}) − logsumexp_v (h_t · w_v), for final-normed hidden states h [T, H]
and this rank's output-weight shard W [V_local, H] (rows vocab_start .. vocab_start+V_local
of the vocab; the tied embedding when the checkpoint ties them).

Forward: tokens in chunks of `chunk`; each chunk's logits h_c W^T exist only while they
reduce to per-row partials (`logprob_partials`: Triton on GPU, torch elsewhere), which go
into [T] buffers. At TP > 1 the whole source's partials combine in one MAX and one SUM
all-reduce (not one pair per chunk). Only lse [T] is kept for backward.

Backward: the chunk's logits are recomputed (the one piece of extra work: one more
h_c W^T GEMM per chunk), dlogits = g_t (onehot(a_t) − softmax) by `scored_logprob_backward`,
then grad_h_c = dlogits W and grad_W += dlogits^T h_c (an FP32 accumulator for 16-bit
weights). grad_h is this rank's partial: at TP > 1 the caller makes it whole with an
all-reduce over TP (model/ passes the hidden states through Megatron's
`copy_to_tensor_model_parallel_region`, as ColumnParallelLinear does with its input).

Peak extra memory: the chunk's logits and their gradient, grad_h and the weight-gradient
accumulator, O(chunk·V/TP + T·H + V/TP·H) (`peak_bytes`), where the unfused path holds
O(T·V/TP) twice. The same shape as Liger-Kernel's FusedLinearCrossEntropy and verl's
linear_cross_entropy; unlike Liger, the gradient is not computed in the forward because
the per-token weights (IS ratios, OPD's teacher terms) are only known at backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tsync_mcore.kernels.scored_logprob import (
    LogprobPartials,
    acc_dtype,
    logprob_partials,
    reduce_partials,
    scored_logprob_backward,
)

__all__ = ["fused_lm_head_logprob", "peak_bytes", "unfused_peak_bytes"]


def _chunks(n: int, chunk: int):
    for a in range(0, n, chunk):
        yield a, min(a + chunk, n)


class _FusedLMHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, tp_group, chunk, with_entropy):
        n = hidden.shape[0]
        acc = acc_dtype(hidden.dtype)
        dev = hidden.device
        m = torch.empty(n, dtype=acc, device=dev)
        s = torch.empty(n, dtype=acc, device=dev)
        tgt = torch.empty(n, dtype=acc, device=dev)
        w = torch.empty(n, dtype=acc, device=dev) if with_entropy else None
        for a, b in _chunks(n, chunk):
            part = logprob_partials(hidden[a:b] @ weight.t(), targets[a:b], vocab_start,
                                    entropy=with_entropy)
            m[a:b], s[a:b], tgt[a:b] = part.m, part.s, part.tgt
            if w is not None:
                w[a:b] = part.w
            del part  # the chunk's logits go here, before the next chunk's exist
        # the whole source in one MAX + one SUM collective at TP > 1
        lse, tgt_sum, ent = reduce_partials(LogprobPartials(m, s, tgt, w), tp_group)
        ent = ent if ent is not None else lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.vocab_start, ctx.chunk = vocab_start, chunk
        ctx.set_materialize_grads(False)  # an unused entropy (a metric) costs nothing
        return tgt_sum - lse, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        if need_w:  # FP32 accumulation across chunks for 16-bit weights
            grad_w = torch.zeros(weight.shape, dtype=acc_dtype(weight.dtype), device=weight.device)
        for a, b in _chunks(hidden.shape[0], ctx.chunk):
            h = hidden[a:b]
            dlogits = scored_logprob_backward(
                h @ weight.t(), targets[a:b], ctx.vocab_start, lse[a:b], grad_logp[a:b],
                grad_ent=None if grad_ent is None else grad_ent[a:b],
                ent=None if grad_ent is None else ent[a:b])
            if grad_h is not None:
                torch.mm(dlogits, weight, out=grad_h[a:b])
            if grad_w is not None:
                if grad_w.dtype == dlogits.dtype:  # out=, not addmm_: FLOP counters see it
                    torch.addmm(grad_w, dlogits.t(), h, out=grad_w)
                else:
                    grad_w.add_(dlogits.t() @ h)
            del dlogits
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)  # autograd hands the parameter its own dtype
        return grad_h, grad_w, None, None, None, None, None


def fused_lm_head_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight^T)[t, targets[t]] over the full (possibly TP-sharded) vocab.

    ``hidden`` [T, H] (final-normed), ``weight`` [V_local, H] (this rank's vocab rows from
    ``vocab_start``), ``targets`` [T] global ids. Returns [T] in fp32 (fp64 for fp64 inputs),
    identical on every rank of ``tp_group``; with ``with_entropy``, ``(logp, entropy)``
    (the entropy differentiable, as in ``scored_logprob``). Targets outside the vocab get −lse, as in ``scored_logprob``.
    The gradient w.r.t. ``hidden`` is this rank's vocab shard's part (see the module doc).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be "
                         f"[T, H] and [V_local, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [{hidden.shape[0]}]")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    logp, ent = _FusedLMHead.apply(hidden.contiguous(), weight, targets.to(torch.int64).contiguous(),
                                   int(vocab_start), tp_group, int(chunk), with_entropy)
    return (logp, ent) if with_entropy else logp


def peak_bytes(n_tokens: int, hidden: int, vocab_local: int, chunk: int,
               dtype: torch.dtype) -> int:
    """Bytes the fused head allocates at its peak (backward) for one call, by its own count:
    a chunk's logits and their gradient (2·c·V_local·b), grad_h (T·H·b), the weight-gradient
    accumulator (V_local·H·4, fp32; 8 for fp64) plus its per-chunk product for 16-bit
    weights (V_local·H·b), and the [T] lse/partials. The [T, H] hidden states it reads and
    the torch fallback's column-chunked temporaries (bounded, a few MB) are not counted."""
    b = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=acc_dtype(dtype)).element_size()
    c = min(chunk, n_tokens)
    product = vocab_local * hidden * b if acc != b else 0
    return (2 * c * vocab_local * b + n_tokens * hidden * b
            + vocab_local * hidden * acc + product + 4 * n_tokens * acc)


def unfused_peak_bytes(n_positions: int, n_scored: int, vocab_local: int,
                       dtype: torch.dtype) -> int:
    """The same count for the unfused path: the [S, V_local] logits of every position, the
    scored rows' copy [T, V_local], and the gradients of both."""
    b = torch.empty((), dtype=dtype).element_size()
    return 2 * (n_positions + n_scored) * vocab_local * b
