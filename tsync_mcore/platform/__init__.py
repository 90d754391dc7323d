"""Where we run: CUDA + NCCL when a GPU is present, else CPU + gloo (see platform/cpu.py)."""

from __future__ import annotations

import torch

__all__ = ["on_gpu", "device", "backend"]


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
