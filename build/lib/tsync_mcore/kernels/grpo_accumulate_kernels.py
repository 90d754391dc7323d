"""Triton kernels for the flat gradient accumulators (imported only when Triton is usable).

Scalars are declared fp64 so fp64 accumulators see the exact Python float (compiled
Triton passes an unannotated float as fp32), and enter the math through
``tl.full([], x, acc_ty)``: the interpreter hands kernels raw Python floats, which
plain arithmetic would round to fp32. Offsets are int64: flat sizes reach billions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def accumulate_g1g2_kernel(g1_ptr, g2_ptr, grad_ptr, r: tl.float64, n_elements, BLOCK: tl.constexpr):
    """g1 += r * grad; g2 += grad, reading grad once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    acc_ty = g1_ptr.dtype.element_ty
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    g1 = tl.load(g1_ptr + offs, mask=mask, other=0.0)
    g2 = tl.load(g2_ptr + offs, mask=mask, other=0.0)
    tl.store(g1_ptr + offs, g1 + tl.full([], r, acc_ty) * grad, mask=mask)
    tl.store(g2_ptr + offs, g2 + grad, mask=mask)


@triton.jit
def combine_group_kernel(
    acc_ptr, g1_ptr, g2_ptr, mu: tl.float64, scale: tl.float64, n_elements, BLOCK: tl.constexpr
):
    """acc += (g1 - mu * g2) * scale."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    acc_ty = acc_ptr.dtype.element_ty
    acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    g1 = tl.load(g1_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    g2 = tl.load(g2_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    mu_ = tl.full([], mu, acc_ty)
    scale_ = tl.full([], scale, acc_ty)
    tl.store(acc_ptr + offs, acc + (g1 - mu_ * g2) * scale_, mask=mask)


@triton.jit
def axpy_kernel(acc_ptr, grad_ptr, a: tl.float64, n_elements, BLOCK: tl.constexpr,
                FRESH: tl.constexpr):
    """acc += a * grad, or acc = a * grad when FRESH (acc is not read)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    acc_ty = acc_ptr.dtype.element_ty
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    out = tl.full([], a, acc_ty) * grad
    if not FRESH:
        out += tl.load(acc_ptr + offs, mask=mask, other=0.0)
    tl.store(acc_ptr + offs, out, mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def accumulate_g1g2_(g1: torch.Tensor, g2: torch.Tensor, grad: torch.Tensor, r: float) -> None:
    n = g1.numel()
    if n:
        accumulate_g1g2_kernel[_grid(n)](g1, g2, grad, float(r), n, BLOCK=BLOCK, num_warps=NUM_WARPS)


def combine_group_(acc: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, mu: float, scale: float) -> None:
    n = acc.numel()
    if n:
        combine_group_kernel[_grid(n)](acc, g1, g2, float(mu), float(scale), n, BLOCK=BLOCK, num_warps=NUM_WARPS)


def axpy_(acc: torch.Tensor, grad: torch.Tensor, a: float, fresh: bool = False) -> None:
    n = acc.numel()
    if n:
        axpy_kernel[_grid(n)](acc, grad, float(a), n, BLOCK=BLOCK, FRESH=bool(fresh),
                              num_warps=NUM_WARPS)
