"""tsync_mcore.kernels: numerics vs FP64 torch references, TP combine, dispatch, sm_90 AOT compile.

The Triton checks run in subprocesses (tests/kernel_checks.py): the interpreter needs
TRITON_INTERPRET=1 before Triton's first import, the AOT compile needs it unset, and
another test in this process may already have imported Triton either way. The three
subprocesses start together once per module and run concurrently.
"""

from __future__ import annotations

import pytest
import torch

from tsync_mcore.kernels import dispatch


@pytest.fixture
def cpu_tensor() -> torch.Tensor:
    return torch.zeros(1)


@pytest.mark.parametrize("available,interpret,mode,expected", [
    (True, "1", "auto", "triton-interpreter"),
    (True, "1", "triton", "triton-interpreter"),
    (True, "1", "torch", "torch"),
    (True, None, "auto", "torch"),
    (False, "1", "auto", "torch"),
    (False, None, "torch", "torch"),
])
def test_backend_for(monkeypatch, cpu_tensor, available, interpret, mode, expected):
    monkeypatch.setattr(dispatch, "triton_available", lambda: available)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setenv(dispatch.BACKEND_ENV, mode)
    assert dispatch.backend_for(cpu_tensor) == expected


@pytest.mark.parametrize("available,interpret", [(True, None), (False, "1")])
def test_forced_triton_on_unusable_device_raises(monkeypatch, cpu_tensor, available, interpret):
    monkeypatch.setattr(dispatch, "triton_available", lambda: available)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    with pytest.raises(RuntimeError, match="Triton cannot run here"):
        dispatch.backend_for(cpu_tensor)


def test_unknown_mode_rejected(monkeypatch, cpu_tensor):
    monkeypatch.setenv(dispatch.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError):
        dispatch.backend_for(cpu_tensor)


def test_accumulate_rejects_bad_inputs():
    from tsync_mcore.kernels import accumulate_g1g2_

    with pytest.raises(ValueError):
        accumulate_g1g2_(torch.zeros(4), torch.zeros(4), torch.zeros(5), 1.0)
    with pytest.raises(ValueError):  # strided: in-place update of a copy would be lost
        accumulate_g1g2_(torch.zeros(8)[::2], torch.zeros(4), torch.zeros(4), 1.0)
    with pytest.raises(TypeError):
        accumulate_g1g2_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16),
                         torch.zeros(4), 1.0)
