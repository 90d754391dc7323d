"""Peak memory per learner rank (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report).

GPU: `torch.cuda.max_memory_allocated()` after a reset once model + optimizer are resident,
plus reserved bytes and NVML device memory used (which includes other processes and the CUDA
context) separately. CPU: peak and current resident set size of the process.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch

from tsync_mcore.observability.ledger.nvml import load_nvml, torch_device_uuids

__all__ = ["MemoryMeter", "current_rss_bytes", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Process-lifetime peak RSS: /proc/self/status's VmHWM where there is one, else getrusage
    (KiB on Linux, bytes on macOS).

    why VmHWM first: Linux carries ru_maxrss across fork + exec, so a process started by a
    large parent (a pytest worker, a launcher that loaded a model) reports the parent's RSS at
    the fork as its own peak; VmHWM is the peak of this process image only.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int:
    """Current RSS from /proc/self/statm (falls back to the peak where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


class MemoryMeter:
    """Per-rank memory: call `reset_after_setup()` once model + optimizer are resident."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")  # fmt: skip
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.setup_bytes: int | None = None
        self._nvml: Any = None
        self._nvml_handle: Any = None
        self.nvml_reason: str | None = None
        if self.on_gpu:
            self._nvml, self.nvml_reason = load_nvml()
            if self._nvml is not None:
                idx = self.device.index if self.device.index is not None else 0
                try:
                    uuid = torch_device_uuids([idx])[0][1]
                    self._nvml_handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
                except Exception as e:
                    self.nvml_reason = f"{type(e).__name__}: {e}"

    def reset_after_setup(self) -> None:
        """Start the peak window here; records what is resident now as `setup_bytes`."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.setup_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.setup_bytes = current_rss_bytes()

    def snapshot(self, host_accum_bytes: int | None = None) -> dict:
        """Metrics dict; `peak_mem_bytes` is docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report's figure, this backend."""
        out: dict = {"backend": self.device.type, "setup_bytes": self.setup_bytes,
                     "host_accum_bytes": host_accum_bytes}  # fmt: skip
        if not self.on_gpu:
            # why: the high-water mark cannot be reset, so on CPU the peak covers the process
            # lifetime; it lags the live RSS, so take the larger of the two
            rss = current_rss_bytes()
            out.update(peak_mem_bytes=max(peak_rss_bytes(), rss), rss_bytes=rss,
                       peak_source="VmHWM (process lifetime)")  # fmt: skip
            return out
        used = None
        if self._nvml_handle is not None:
            try:
                used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._nvml_handle).used)
            except Exception as e:
                self.nvml_reason = f"{type(e).__name__}: {e}"
        out.update(
            peak_mem_bytes=torch.cuda.max_memory_allocated(self.device),
            allocated_bytes=torch.cuda.memory_allocated(self.device),
            reserved_bytes=torch.cuda.memory_reserved(self.device),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device),
            nvml_used_bytes=used,
            nvml_reason=self.nvml_reason,
            peak_source="cuda.max_memory_allocated (since reset_after_setup)"
            if self.setup_bytes is not None else "cuda.max_memory_allocated (no reset)",
        )  # fmt: skip
        return out
