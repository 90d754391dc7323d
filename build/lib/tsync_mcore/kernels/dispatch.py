"""Per-call choice between the Triton kernels and the plain-torch fallbacks.

Triton is imported lazily: the package must import (and fall back to torch) on
machines without Triton, and ``TRITON_INTERPRET`` is only honoured if it is set
before Triton's first import, so nothing here imports Triton at module load.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["BACKEND_ENV", "backend_for", "interpreter_enabled", "triton_available", "triton_usable"]

# torch | triton | auto (default). "triton" on a device Triton cannot serve is an error,
# so a forced choice never silently degrades to the slow path.
BACKEND_ENV = "TSYNC_KERNELS"
_MODES = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works in this process."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors through the Triton interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``tensor``'s device in this process."""
    if not triton_available():
        return False
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and interpreter_enabled()


def _mode() -> str:
    mode = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{BACKEND_ENV}={mode!r}; expected one of {_MODES}")
    return mode


def backend_for(tensor: torch.Tensor) -> str:
    """The backend a kernel call on ``tensor`` will use: "triton", "triton-interpreter" or "torch"."""
    mode = _mode()
    if mode == "torch":
        return "torch"
    if triton_usable(tensor):
        return "triton-interpreter" if interpreter_enabled() else "triton"
    if mode == "triton":
        reason = "triton is not importable" if not triton_available() else (
            f"device {tensor.device} needs CUDA (or TRITON_INTERPRET=1 for CPU tensors)"
        )
        raise RuntimeError(f"{BACKEND_ENV}=triton but Triton cannot run here: {reason}")
    return "torch"
