"""Triton kernels for the scored-token log-prob (imported only when Triton is usable).

Accumulation happens in the dtype of the fp32/fp64 outputs (``m_ptr`` / ``lse_ptr``),
never in the logits dtype: the interpreter mishandles bf16 arithmetic and bf16
sums lose far too much precision anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# GPU launch shape. A 4096-wide chunk keeps ~16 elements per thread at 8 warps (wide
# vector loads for bf16); the interpreter pays per element-op, so it gets narrow chunks.
GPU_BLOCK_V = 4096
GPU_NUM_WARPS = 8
INTERPRETER_BLOCK_V = 128


@triton.jit
def scored_logprob_fwd_kernel(
    logits_ptr,
    targets_ptr,
    m_ptr,
    s_ptr,
    tgt_ptr,
    w_ptr,
    n_cols,
    stride_row,
    vocab_start,
    BLOCK_V: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    """One program per row: online max / sum-exp over vocab chunks, plus the target logit;
    ENTROPY: also w = sum exp(x - m) * (x - m), the row's share of the entropy."""
    row = tl.program_id(0).to(tl.int64)
    acc_ty = m_ptr.dtype.element_ty
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)

    m = tl.full([], float("-inf"), acc_ty)
    s = tl.zeros([], acc_ty)
    w = tl.zeros([], acc_ty)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(acc_ty)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # An all -inf prefix (masked vocab) would give exp(-inf - -inf) = NaN; rescale by 0 instead.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new).to(acc_ty)
        alpha = tl.exp(m - m_ref)
        e = tl.exp(x - m_ref)
        if ENTROPY:  # rescaled to the new max: alpha * (w + (m - m_ref) * s); -inf lanes add 0
            shift = tl.where(m == float("-inf"), 0.0, m - m_ref).to(acc_ty)
            w = alpha * (w + shift * s) + tl.sum(e * tl.where(e > 0, x - m_ref, 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new

    # Targets are global ids; only the shard owning the id contributes its logit.
    local = tl.load(targets_ptr + row) - vocab_start
    owned = (local >= 0) & (local < n_cols)
    tgt = tl.load(row_ptr + local, mask=owned, other=0.0).to(acc_ty)

    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(tgt_ptr + row, tgt)
    if ENTROPY:
        tl.store(w_ptr + row, w)


@triton.jit
def scored_logprob_bwd_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    grad_logp_ptr,
    grad_logits_ptr,
    grad_ent_ptr,
    ent_ptr,
    n_cols,
    stride_row,
    grad_stride_row,
    vocab_start,
    BLOCK_V: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    """Grid (rows, vocab chunks): grad = grad_logp * (onehot(target) - softmax); ENTROPY:
    also the entropy's term, - grad_ent * p * (x - lse + H)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    acc_ty = lse_ptr.dtype.element_ty
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < n_cols

    x = tl.load(logits_ptr + row * stride_row + offs, mask=mask, other=0.0).to(acc_ty)
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_logp_ptr + row).to(acc_ty)
    local = tl.load(targets_ptr + row) - vocab_start

    onehot = tl.where(offs == local, 1.0, 0.0).to(acc_ty)
    p = tl.exp(x - lse)
    grad = g * (onehot - p)
    if ENTROPY:
        ge = tl.load(grad_ent_ptr + row).to(acc_ty)
        h = tl.load(ent_ptr + row).to(acc_ty)
        grad = grad - ge * p * (tl.where(p > 0, x - lse, 0.0) + h)  # p = 0: no 0·(−inf)
    out_ty = grad_logits_ptr.dtype.element_ty
    tl.store(grad_logits_ptr + row * grad_stride_row + offs, grad.to(out_ty), mask=mask)


def _block_v(n_cols: int, on_gpu: bool, block_v: int | None) -> int:
    if block_v is None:
        block_v = GPU_BLOCK_V if on_gpu else INTERPRETER_BLOCK_V
    return min(block_v, triton.next_power_of_2(max(n_cols, 1)))


def partials(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    acc_dtype: torch.dtype,
    block_v: int | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(m, s, tgt, w) per row of a row-major ``[T, V]`` logits shard; w is None unless ``entropy``."""
    n_rows, n_cols = logits.shape
    m, s, tgt = (torch.empty(n_rows, dtype=acc_dtype, device=logits.device) for _ in range(3))
    w = torch.empty_like(m) if entropy else None
    if n_rows == 0:
        return m, s, tgt, w
    bv = _block_v(n_cols, logits.is_cuda, block_v)
    scored_logprob_fwd_kernel[(n_rows,)](
        logits, targets, m, s, tgt, m if w is None else w, n_cols, logits.stride(0), vocab_start,
        BLOCK_V=bv, ENTROPY=entropy, num_warps=GPU_NUM_WARPS,
    )
    return m, s, tgt, w


def backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    block_v: int | None = None,
    grad_ent: torch.Tensor | None = None,
    ent: torch.Tensor | None = None,
) -> torch.Tensor:
    """grad wrt a row-major ``[T, V]`` logits shard, in the logits dtype (with the entropy's
    term when ``grad_ent`` is given)."""
    n_rows, n_cols = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n_rows == 0 or n_cols == 0:
        return grad
    bv = _block_v(n_cols, logits.is_cuda, block_v)
    # Rows on grid axis 0: it allows 2**31 - 1 programs, axis 1 only 65535.
    grid = (n_rows, triton.cdiv(n_cols, bv))
    scored_logprob_bwd_kernel[grid](
        logits, targets, lse, grad_logp, grad, lse if grad_ent is None else grad_ent,
        lse if ent is None else ent, n_cols, logits.stride(0), grad.stride(0), vocab_start,
        BLOCK_V=bv, ENTROPY=grad_ent is not None, num_warps=GPU_NUM_WARPS,
    )
    return grad
