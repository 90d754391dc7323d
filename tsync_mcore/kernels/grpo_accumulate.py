"""Single-pass updates of the flat fp32/fp64 gradient accumulators used by GRPO streaming.

Per sample: g1 += r * grad, g2 += grad (r = reward). Per group, with mean reward mu:
sum_i (r_i - mu) * grad_i = g1 - mu * g2, so acc += (g1 - mu * g2) * scale folds a whole
group in without keeping per-sample gradients.
"""

from __future__ import annotations

from typing import Iterator

import torch

from tsync_mcore.kernels.dispatch import backend_for

__all__ = ["accumulate_g1g2_", "axpy_", "combine_group_"]

_ACC_DTYPES = (torch.float32, torch.float64)
# Torch fallback: temporaries (a converted bf16 grad, g1 − mu·g2) are made this many
# elements at a time into one reused buffer, so they never need a full-size copy and stay
# in cache between the op that writes them and the one that reads them (1 MiB in fp32;
# the timing: docs/measured/learner-cpu.md).
_TORCH_CHUNK = 1 << 18


def _check(accs: tuple[torch.Tensor, ...], ins: tuple[torch.Tensor, ...]) -> None:
    first = accs[0]
    # Any shape is accepted as long as the memory is contiguous: the ops are elementwise
    # over the flat storage (Megatron grad buffers are 1-D already).
    for t in accs + ins:
        if not t.is_contiguous():
            raise ValueError(f"expected contiguous tensors, got strides {t.stride()} for shape {tuple(t.shape)}")
        if t.numel() != first.numel() or t.device != first.device:
            raise ValueError("all tensors must have the same numel and device")
    for t in accs:
        if t.dtype != first.dtype or t.dtype not in _ACC_DTYPES:
            raise TypeError(f"accumulators must share one dtype in {_ACC_DTYPES}, got {t.dtype}")


def _chunks(n: int) -> Iterator[slice]:
    for start in range(0, n, _TORCH_CHUNK):
        yield slice(start, min(start + _TORCH_CHUNK, n))


def _buffer(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(min(like.numel(), _TORCH_CHUNK), dtype=like.dtype, device=like.device)


def accumulate_g1g2_(g1: torch.Tensor, g2: torch.Tensor, grad: torch.Tensor, r: float) -> None:
    """In place: ``g1 += r * grad; g2 += grad`` (grad cast to the accumulator dtype)."""
    _check((g1, g2), (grad,))
    g1, g2, grad = g1.view(-1), g2.view(-1), grad.view(-1)
    if backend_for(g1) != "torch":
        from tsync_mcore.kernels import grpo_accumulate_kernels as kernels

        kernels.accumulate_g1g2_(g1, g2, grad, r)
        return
    if grad.dtype == g1.dtype:
        g1.add_(grad, alpha=r)
        g2.add_(grad)
        return
    buf = _buffer(g1)
    for sl in _chunks(g1.numel()):
        chunk = buf[: sl.stop - sl.start].copy_(grad[sl])
        g1[sl].add_(chunk, alpha=r)
        g2[sl].add_(chunk)


def combine_group_(acc: torch.Tensor, g1: torch.Tensor, g2: torch.Tensor, mu: float, scale: float) -> None:
    """In place: ``acc += (g1 - mu * g2) * scale``."""
    _check((acc, g1, g2), ())
    acc, g1, g2 = acc.view(-1), g1.view(-1), g2.view(-1)
    if backend_for(acc) != "torch":
        from tsync_mcore.kernels import grpo_accumulate_kernels as kernels

        kernels.combine_group_(acc, g1, g2, mu, scale)
        return
    buf = _buffer(acc)
    for sl in _chunks(acc.numel()):
        # (g1 − mu·g2) first, then scaled into acc: the difference cancels before scaling,
        # as in the kernel (a huge 1/σ scale must not meet g1 and g2 separately)
        diff = torch.add(g1[sl], g2[sl], alpha=-mu, out=buf[: sl.stop - sl.start])
        acc[sl].add_(diff, alpha=scale)


def axpy_(acc: torch.Tensor, grad: torch.Tensor, a: float, fresh: bool = False) -> None:
    """In place: ``acc += a * grad`` (grad cast to the accumulator dtype, the product
    formed in it). ``fresh``: ``acc = a * grad``; acc's old contents are never read, so a
    reused buffer needs no zeroing first (one write instead of a zero pass and a read)."""
    _check((acc,), (grad,))
    acc, grad = acc.view(-1), grad.view(-1)
    if backend_for(acc) != "torch":
        from tsync_mcore.kernels import grpo_accumulate_kernels as kernels

        kernels.axpy_(acc, grad, a, fresh)
        return
    if grad.dtype == acc.dtype:
        if fresh:
            torch.mul(grad, a, out=acc)
        else:
            acc.add_(grad, alpha=a)
        return
    if fresh:
        for sl in _chunks(acc.numel()):
            acc[sl].copy_(grad[sl]).mul_(a)  # cast first: the product is formed in acc's dtype
        return
    buf = _buffer(acc)
    for sl in _chunks(acc.numel()):
        acc[sl].add_(buf[: sl.stop - sl.start].copy_(grad[sl]), alpha=a)
