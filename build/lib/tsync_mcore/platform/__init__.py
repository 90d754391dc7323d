"""Where we run: CUDA + NCCL when a GPU is present, else CPU + gloo (see platform/cpu.py)."""

from __future__ import annotations

import torch

__all__ = ["on_gpu", "device", "backend", "upload"]


def on_gpu() -> bool:
    """True when CUDA is usable; every CPU fallback in the project keys off this."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on (the current CUDA device, or the CPU)."""
    if on_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    """torch.distributed backend matching `device()`."""
    return "nccl" if on_gpu() else "gloo"


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without making the host wait for the device.

    `torch.tensor(values, device=cuda)` copies from pageable memory and synchronises the
    stream (the host waits for every kernel queued before it); staged in pinned memory the
    copy is asynchronous, and the caching host allocator keeps the staging block until
    the copy is done. On the CPU this is plain `torch.tensor`."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)
