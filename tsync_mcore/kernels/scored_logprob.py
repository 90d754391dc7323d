"""Fused log-prob of the scored (sampled) token over possibly vocab-parallel logits.

logp_t = logits[t, a_t] - logsumexp(logits[t, :]), computed without materializing a
[T, V] softmax. Each TP rank reduces its vocab shard to per-row partials
(m = row max, s = sum exp(logit - m), tgt = logit at a_t if the shard owns a_t, else 0);
partials combine across shards as M = max m, S = sum s * exp(m - M), lse = M + log S,
target logit = sum tgt. The backward needs only the global lse, so it has no collective.

On request (``with_entropy``) the same pass also gives the entropy of the row's distribution,
H = -sum p log p, with one more partial per shard, w = sum exp(logit - m) * (logit - m):
rescaled to the global max M it combines as W = sum e^(m - M) * (w + (m - M) * s), and
H = log S - W / S (both terms >= 0, so no cancellation). w rides in the same SUM collective.
The entropy is differentiable (an entropy bonus): dH/dlogit_j = -p_j (logit_j - lse + H),
from the global lse and H, so its backward needs no collective either and joins the log-prob's
in one pass over the logits.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from tsync_mcore.kernels.dispatch import backend_for

__all__ = [
    "LogprobPartials",
    "acc_dtype",
    "all_reduce_partials",
    "combine_partials",
    "logprob_partials",
    "reduce_partials",
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
    w: torch.Tensor | None = None  # sum exp(logit - m) * (logit - m); None unless asked


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partials and gradients accumulate in: fp64 for fp64, else fp32."""
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch.float32
    raise TypeError(f"unsupported logits dtype {dtype}")


def _safe_ref(m: torch.Tensor) -> torch.Tensor:
    # exp(-inf - -inf) is NaN; a row whose max is -inf has nothing to rescale.
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _shift(m: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    # m - ref where the shard (or prefix) has a max; an all -inf one holds s = w = 0.
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m - ref)


def _target_columns(targets: torch.Tensor, vocab_start: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = targets - vocab_start
    owned = (local >= 0) & (local < n_cols)
    return local, owned


def _chunk_cols(n_rows: int, n_cols: int) -> int:
    return max(1, min(n_cols, _TORCH_CHUNK_ELEMS // max(n_rows, 1)))


def _partials_torch(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, entropy: bool = False
) -> LogprobPartials:
    n_rows, n_cols = logits.shape
    acc = acc_dtype(logits.dtype)
    m = torch.full((n_rows,), float("-inf"), dtype=acc, device=logits.device)
    s = torch.zeros(n_rows, dtype=acc, device=logits.device)
    w = torch.zeros(n_rows, dtype=acc, device=logits.device) if entropy else None
    step = _chunk_cols(n_rows, n_cols)
    for start in range(0, n_cols, step):
        x = logits[:, start : start + step].to(acc)
        m_new = torch.maximum(m, x.amax(dim=1))
        ref = _safe_ref(m_new)
        alpha = torch.exp(m - ref)
        d = x - ref[:, None]
        e = torch.exp(d)
        s_new = s * alpha + e.sum(dim=1)
        if w is not None:  # rescaled to the new max; -inf logits (e = 0) add 0, not NaN
            contrib = d.clamp_min_(torch.finfo(acc).min).mul_(e).sum(dim=1)  # in place: d is ours
            w = alpha * (w + _shift(m, ref) * s) + contrib
        s = s_new
        m = m_new
    local, owned = _target_columns(targets, vocab_start, n_cols)
    picked = logits.gather(1, local.clamp(0, max(n_cols - 1, 0))[:, None]).squeeze(1).to(acc)
    tgt = torch.where(owned, picked, torch.zeros_like(picked))
    return LogprobPartials(m, s, tgt, w)


def _backward_torch(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, lse: torch.Tensor, grad_logp: torch.Tensor,
    grad_ent: torch.Tensor | None = None, ent: torch.Tensor | None = None,
) -> torch.Tensor:
    n_rows, n_cols = logits.shape
    acc = lse.dtype
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    local, owned = _target_columns(targets, vocab_start, n_cols)
    g = grad_logp.to(acc)[:, None]
    step = _chunk_cols(n_rows, n_cols)
    for start in range(0, n_cols, step):
        # g·(0 − p) off the target column (the same IEEE value as g·(onehot − p) there)
        x = logits[:, start : start + step].to(acc)
        p = (x - lse[:, None]).exp_()
        if grad_ent is None:
            grad[:, start : start + step] = p.mul_(g).neg_()
        else:  # − p·(g + g_H·(x − lse + H))
            lp = x - lse[:, None]  # log p; −inf logits (p = 0) contribute 0, not 0·(−inf)
            d = lp.masked_fill_(torch.isneginf(lp), 0.0).add_(ent[:, None]).mul_(grad_ent[:, None])
            grad[:, start : start + step] = p.mul_(d.add_(g)).neg_()
    # The target column: g·(1 − p), in the accumulation dtype and rounded once, as a one-hot
    # formula would give it, without building a [T, V] comparison (rows whose target is on
    # another shard keep their value).
    rows = torch.arange(n_rows, device=logits.device)
    cols = local.clamp(0, max(n_cols - 1, 0))
    x = logits[rows, cols].to(acc)
    val = g[:, 0] * (1 - torch.exp(x - lse))
    if grad_ent is not None:
        lp = x - lse
        val = val - grad_ent * torch.exp(lp) * (torch.where(torch.isneginf(lp), 0.0, lp) + ent)
    grad[rows, cols] = torch.where(owned, val.to(grad.dtype), grad[rows, cols])
    return grad


def logprob_partials(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    *,
    block_v: int | None = None,
    entropy: bool = False,
) -> LogprobPartials:
    """Partials of one vocab shard; ``logits`` is ``[T, Vlocal]``, ``targets`` ``[T]`` global ids.

    ``block_v`` overrides the Triton chunk width (tests); the torch fallback ignores it.
    ``entropy`` also fills ``w`` (in the same pass over the logits, both backends).
    """
    logits = logits.contiguous()
    targets = targets.to(torch.int64).contiguous()
    if backend_for(logits) == "torch":
        return _partials_torch(logits, targets, vocab_start, entropy)
    from tsync_mcore.kernels import scored_logprob_kernels as kernels

    acc = acc_dtype(logits.dtype)
    return LogprobPartials(*kernels.partials(logits, targets, vocab_start, acc, block_v, entropy))


def scored_logprob_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    *,
    block_v: int | None = None,
    grad_ent: torch.Tensor | None = None,
    ent: torch.Tensor | None = None,
) -> torch.Tensor:
    """dL/dlogits of one shard: ``grad_logp[t] * (onehot(a_t) - exp(logits - lse[t]))``, logits dtype;
    with ``grad_ent`` (and the rows' entropy ``ent``) also ``- grad_ent[t] * p * (logits - lse[t] + H[t])``."""
    logits = logits.contiguous()
    targets = targets.to(torch.int64).contiguous()
    acc = acc_dtype(logits.dtype)
    lse = lse.to(acc).contiguous()
    grad_logp = grad_logp.contiguous()
    if grad_ent is not None:
        grad_ent, ent = grad_ent.to(acc).contiguous(), ent.to(acc).contiguous()
    if backend_for(logits) == "torch":
        return _backward_torch(logits, targets, vocab_start, lse, grad_logp, grad_ent, ent)
    from tsync_mcore.kernels import scored_logprob_kernels as kernels

    return kernels.backward(logits, targets, vocab_start, lse, grad_logp, block_v, grad_ent, ent)


def _finish(m_max: torch.Tensor, s_sum: torch.Tensor, tgt_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return m_max + torch.log(s_sum), tgt_sum


def _rescaled_w(part: LogprobPartials, ref: torch.Tensor) -> torch.Tensor:
    """The shard's w relative to the global max: e^(m - M) * (w + (m - M) * s)."""
    return torch.exp(part.m - ref) * (part.w + _shift(part.m, ref) * part.s)


def _entropy(s_sum: torch.Tensor, w_sum: torch.Tensor) -> torch.Tensor:
    return torch.log(s_sum) - w_sum / s_sum


def _combine(parts: Sequence[LogprobPartials]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    m_max = torch.stack([p.m for p in parts]).amax(dim=0)
    ref = _safe_ref(m_max)
    s_sum = sum(p.s * torch.exp(p.m - ref) for p in parts)
    tgt_sum = sum(p.tgt for p in parts)
    ent = None
    if all(p.w is not None for p in parts):
        ent = _entropy(s_sum, sum(_rescaled_w(p, ref) for p in parts))
    return (*_finish(m_max, s_sum, tgt_sum), ent)


def combine_partials(parts: Sequence[LogprobPartials]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, target logit) from the partials of every vocab shard of the same rows."""
    return _combine(parts)[:2]


def combine_entropy(parts: Sequence[LogprobPartials]) -> torch.Tensor:
    """Entropy per row from the partials (with ``w``) of every vocab shard of the same rows."""
    if any(p.w is None for p in parts):
        raise ValueError("combine_entropy needs partials made with entropy=True")
    return _combine(parts)[2]


def _all_reduce(part: LogprobPartials, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    m_max = part.m.clone()
    dist.all_reduce(m_max, op=dist.ReduceOp.MAX, group=group)
    ref = _safe_ref(m_max)
    # s, tgt (and w) share one SUM collective.
    rows = [part.s * torch.exp(part.m - ref), part.tgt]
    if part.w is not None:
        rows.append(_rescaled_w(part, ref))
    sums = torch.stack(rows)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    ent = _entropy(sums[0], sums[2]) if part.w is not None else None
    return (*_finish(m_max, sums[0], sums[1]), ent)


def all_reduce_partials(part: LogprobPartials, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """``combine_partials`` across the ranks of ``group``: one MAX then one SUM all-reduce."""
    return _all_reduce(part, group)[:2]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def reduce_partials(part: LogprobPartials, group: dist.ProcessGroup | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse, target logit, entropy or None without ``w``) of this rank's rows over the whole
    vocab: across ``group`` when it has more than one rank, else from this shard alone."""
    if _group_size(group) > 1:
        return _all_reduce(part, group)
    ent = _entropy(part.s, part.w) if part.w is not None else None
    return (*_finish(part.m, part.s, part.tgt), ent)


class _ScoredLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        tp_group: dist.ProcessGroup | None,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        part = logprob_partials(logits, targets, vocab_start, entropy=with_entropy)
        lse, tgt, ent = reduce_partials(part, tp_group)
        ent = ent if ent is not None else lse.new_empty(0)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.vocab_start = vocab_start
        ctx.set_materialize_grads(False)  # an unused entropy (a metric) costs nothing
        return tgt - lse, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        logits, targets, lse, ent = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad = scored_logprob_backward(logits, targets, ctx.vocab_start, lse, grad_logp,
                                       grad_ent=grad_ent, ent=ent if grad_ent is not None else None)
        return grad, None, None, None, None


def scored_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits)[..., targets] over the full (possibly TP-sharded) vocab.

    ``logits`` is ``[..., Vlocal]``: this rank's columns ``[vocab_start, vocab_start + Vlocal)``
    of the vocab. ``targets`` is ``[...]`` global token ids. Returns ``[...]`` in fp32 (fp64 for
    fp64 logits), identical on every rank of ``tp_group``. Targets outside the whole vocab (e.g.
    an ignore index) get logp = -lse; mask them downstream.

    ``with_entropy``: returns ``(logp, entropy)``, the entropy of each row's full-vocab
    distribution from the same pass (same shape and dtype, differentiable: an entropy bonus's
    gradient joins the log-prob's in the backward's one pass).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    lead = targets.shape
    # Flatten outside the Function so autograd routes the gradient back through the views.
    logits_2d = logits.reshape(-1, logits.shape[-1]).contiguous()
    targets_1d = targets.reshape(-1).to(torch.int64).contiguous()
    logp, ent = _ScoredLogprob.apply(logits_2d, targets_1d, int(vocab_start), tp_group, with_entropy)
    if with_entropy:
        return logp.reshape(lead), ent.reshape(lead)
    return logp.reshape(lead)
