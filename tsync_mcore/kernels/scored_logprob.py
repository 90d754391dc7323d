"""Fused log-prob of the scored (sampled) token over possibly vocab-parallel logits.

logp_t = logits[t, a_t] - logsumexp(logits[t, :]), computed without materializing a
[T, V] softmax. Each TP rank reduces its vocab shard to per-row partials
(m = row max, s = sum exp(logit - m), tgt = logit at a_t if the shard owns a_t, else 0);
partials combine across shards as M = max m, S = sum s * exp(m - M), lse = M + log S,
target logit = sum tgt. The backward needs only the global lse, so it has no collective.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from tsync_mcore.kernels.dispatch import backend_for

__all__ = [
    "LogprobPartials",
    "all_reduce_partials",
    "combine_partials",
    "logprob_partials",
    "scored_logprob",
    "scored_logprob_backward",
]

# Torch fallback works on column chunks of about this many elements, bounding temporaries.
_TORCH_CHUNK_ELEMS = 1 << 24


class LogprobPartials(NamedTuple):
    """Per-row reductions of one vocab shard, in the accumulation dtype."""

    m: torch.Tensor
    s: torch.Tensor
    tgt: torch.Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch.float32
    raise TypeError(f"unsupported logits dtype {dtype}")


def _safe_ref(m: torch.Tensor) -> torch.Tensor:
    # exp(-inf - -inf) is NaN; a row whose max is -inf has nothing to rescale.
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _target_columns(targets: torch.Tensor, vocab_start: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = targets - vocab_start
    owned = (local >= 0) & (local < n_cols)
    return local, owned


def _chunk_cols(n_rows: int, n_cols: int) -> int:
    return max(1, min(n_cols, _TORCH_CHUNK_ELEMS // max(n_rows, 1)))


def _partials_torch(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> LogprobPartials:
    n_rows, n_cols = logits.shape
    acc = _acc_dtype(logits.dtype)
    m = torch.full((n_rows,), float("-inf"), dtype=acc, device=logits.device)
    s = torch.zeros(n_rows, dtype=acc, device=logits.device)
    step = _chunk_cols(n_rows, n_cols)
    for start in range(0, n_cols, step):
        x = logits[:, start : start + step].to(acc)
        m_new = torch.maximum(m, x.amax(dim=1))
        ref = _safe_ref(m_new)
        s = s * torch.exp(m - ref) + torch.exp(x - ref[:, None]).sum(dim=1)
        m = m_new
    local, owned = _target_columns(targets, vocab_start, n_cols)
    picked = logits.gather(1, local.clamp(0, max(n_cols - 1, 0))[:, None]).squeeze(1).to(acc)
    tgt = torch.where(owned, picked, torch.zeros_like(picked))
    return LogprobPartials(m, s, tgt)


def _backward_torch(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, lse: torch.Tensor, grad_logp: torch.Tensor
) -> torch.Tensor:
    n_rows, n_cols = logits.shape
    acc = lse.dtype
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    local, _ = _target_columns(targets, vocab_start, n_cols)
    g = grad_logp.to(acc)[:, None]
    step = _chunk_cols(n_rows, n_cols)
    for start in range(0, n_cols, step):
        x = logits[:, start : start + step].to(acc)
        cols = torch.arange(start, start + x.shape[1], device=logits.device)
        onehot = (cols[None, :] == local[:, None]).to(acc)
        grad[:, start : start + step] = g * (onehot - torch.exp(x - lse[:, None]))
    return grad


def logprob_partials(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0, *, block_v: int | None = None
) -> LogprobPartials:
    """Partials of one vocab shard; ``logits`` is ``[T, Vlocal]``, ``targets`` ``[T]`` global ids.

    ``block_v`` overrides the Triton chunk width (tests); the torch fallback ignores it.
    """
    logits = logits.contiguous()
    targets = targets.to(torch.int64).contiguous()
    if backend_for(logits) == "torch":
        return _partials_torch(logits, targets, vocab_start)
    from tsync_mcore.kernels import scored_logprob_kernels as kernels

    return LogprobPartials(*kernels.partials(logits, targets, vocab_start, _acc_dtype(logits.dtype), block_v))


def scored_logprob_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """dL/dlogits of one shard: ``grad_logp[t] * (onehot(a_t) - exp(logits - lse[t]))``, logits dtype."""
    logits = logits.contiguous()
    targets = targets.to(torch.int64).contiguous()
    lse = lse.to(_acc_dtype(logits.dtype)).contiguous()
    grad_logp = grad_logp.contiguous()
    if backend_for(logits) == "torch":
        return _backward_torch(logits, targets, vocab_start, lse, grad_logp)
    from tsync_mcore.kernels import scored_logprob_kernels as kernels

    return kernels.backward(logits, targets, vocab_start, lse, grad_logp, block_v)


def _finish(m_max: torch.Tensor, s_sum: torch.Tensor, tgt_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return m_max + torch.log(s_sum), tgt_sum


def combine_partials(parts: Sequence[LogprobPartials]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, target logit) from the partials of every vocab shard of the same rows."""
    m_max = torch.stack([p.m for p in parts]).amax(dim=0)
    ref = _safe_ref(m_max)
    s_sum = sum(p.s * torch.exp(p.m - ref) for p in parts)
    tgt_sum = sum(p.tgt for p in parts)
    return _finish(m_max, s_sum, tgt_sum)


def all_reduce_partials(part: LogprobPartials, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """``combine_partials`` across the ranks of ``group``: one MAX then one SUM all-reduce."""
    m_max = part.m.clone()
    dist.all_reduce(m_max, op=dist.ReduceOp.MAX, group=group)
    # s and tgt share one SUM collective.
    sums = torch.stack([part.s * torch.exp(part.m - _safe_ref(m_max)), part.tgt])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return _finish(m_max, sums[0], sums[1])


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _ScoredLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, tp_group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        part = logprob_partials(logits, targets, vocab_start)
        if _group_size(tp_group) > 1:
            lse, tgt = all_reduce_partials(part, tp_group)
        else:
            lse, tgt = _finish(part.m, part.s, part.tgt)
        ctx.save_for_backward(logits, targets, lse)
        ctx.vocab_start = vocab_start
        return tgt - lse

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        logits, targets, lse = ctx.saved_tensors
        return scored_logprob_backward(logits, targets, ctx.vocab_start, lse, grad_logp), None, None, None


def scored_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """log softmax(logits)[..., targets] over the full (possibly TP-sharded) vocab.

    ``logits`` is ``[..., Vlocal]``: this rank's columns ``[vocab_start, vocab_start + Vlocal)``
    of the vocab. ``targets`` is ``[...]`` global token ids. Returns ``[...]`` in fp32 (fp64 for
    fp64 logits), identical on every rank of ``tp_group``. Targets outside the whole vocab (e.g.
    an ignore index) get logp = -lse; mask them downstream.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    lead = targets.shape
    # Flatten outside the Function so autograd routes the gradient back through the views.
    logits_2d = logits.reshape(-1, logits.shape[-1]).contiguous()
    targets_1d = targets.reshape(-1).to(torch.int64).contiguous()
    logp = _ScoredLogprob.apply(logits_2d, targets_1d, int(vocab_start), tp_group)
    return logp.reshape(lead)
