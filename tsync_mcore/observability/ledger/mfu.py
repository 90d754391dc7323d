"""Trainer active MFU (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report): MFU_k = F_k / (T_step_k · Σ_d P_d).

P_d is the dense BF16 peak of a learner device, from a table by device name; a config value
or `TSYNC_PEAK_TFLOPS` overrides it; a CPU run (or an unknown GPU) uses a peak measured once
per process by a matmul benchmark.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "PEAK_TFLOPS",
    "PEAK_ENV",
    "Peak",
    "detect_peak",
    "measure_matmul_peak",
    "mfu_active",
    "steady_state",
    "steady_state_mfu",
]

# Dense BF16 TFLOP/s (no sparsity), matched as a substring of the upper-cased device name,
# longest key first (so "H100 PCIE" wins over "H100").
PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.5,
    "H100 PCIE": 756.0,
    "H100": 989.5,
}
PEAK_ENV = "TSYNC_PEAK_TFLOPS"


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device and where the figure came from."""

    flops_per_s: float
    source: str  # "config", "env:TSYNC_PEAK_TFLOPS", "table:H200", "measured-cpu-matmul", ...
    device: str

    def __float__(self) -> float:
        return self.flops_per_s

    def to_dict(self) -> dict:
        return {"peak_flops_per_s": self.flops_per_s, "peak_source": self.source,
                "device": self.device}  # fmt: skip


_measured: dict[tuple[str, str, int], Peak] = {}


def measure_matmul_peak(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    min_time_s: float = 0.25,
) -> Peak:
    """Best observed n×n matmul rate on `device`, measured once per process (cached).

    CPU runs compute in fp32 (the CPU default here), so fp32 is the CPU figure; the cache key
    includes the thread count, which changes the peak.
    """
    dev = torch.device(device)
    key = (str(dev), str(dtype), torch.get_num_threads())
    if key in _measured:
        return _measured[key]
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: thread pool / cuBLAS handle
    sync()
    best = math.inf
    start = time.perf_counter()
    reps = 0
    while reps < 3 or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = Peak(2.0 * n**3 / best, f"measured-{dev.type}-matmul", name)
    _measured[key] = peak
    return peak


def _table_lookup(name: str, table: Mapping[str, float]) -> tuple[str, float] | None:
    upper = name.upper()
    for key in sorted(table, key=len, reverse=True):
        if key.upper() in upper:
            return key, table[key]
    return None


def detect_peak(
    override_tflops: float | None = None,
    *,
    device: str | torch.device | None = None,
    table: Mapping[str, float] | None = None,
) -> Peak:
    """Peak of this process's learner device: config > env > table by name > measured."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")  # fmt: skip
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if override_tflops is not None:
        return Peak(float(override_tflops) * 1e12, "config", name)
    env = os.environ.get(PEAK_ENV)
    if env:
        return Peak(float(env) * 1e12, f"env:{PEAK_ENV}", name)
    if dev.type == "cuda":
        hit = _table_lookup(name, PEAK_TFLOPS if table is None else table)
        if hit is not None:
            return Peak(hit[1] * 1e12, f"table:{hit[0]}", name)
        # why: an unlisted GPU still gets a figure, labelled as measured (bf16 as in training)
        return measure_matmul_peak(dev, torch.bfloat16, n=8192)
    return measure_matmul_peak(dev, torch.float32)


def mfu_active(flops: float, step_time_s: float, n_devices: int, peak: float | Peak) -> float:
    """F / (T · Σ_d P_d) with the same peak P on each of `n_devices` learner devices."""
    if step_time_s <= 0 or n_devices < 1 or float(peak) <= 0:
        raise ValueError(
            f"need step_time_s > 0, n_devices >= 1, peak > 0; got {step_time_s}, "
            f"{n_devices}, {float(peak)}"
        )
    return float(flops) / (step_time_s * n_devices * float(peak))


def steady_state(values: Sequence[float], warmup: int = 4) -> float:
    """Mean of `values` after discarding the first `warmup` (paper: 40 updates, first 4 out)."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    kept = list(values)[warmup:]
    if not kept:
        raise ValueError(f"no steady-state values: {len(values)} values, warmup {warmup}")
    return sum(kept) / len(kept)


def steady_state_mfu(
    flops: Sequence[float],
    step_times_s: Sequence[float],
    n_devices: int,
    peak: float | Peak,
    warmup: int = 4,
) -> float:
    """Average of per-update MFU_k over the steady-state updates."""
    if len(flops) != len(step_times_s):
        raise ValueError(f"{len(flops)} FLOP figures but {len(step_times_s)} step times")
    per = [mfu_active(f, t, n_devices, peak) for f, t in zip(flops, step_times_s)]
    return steady_state(per, warmup)
