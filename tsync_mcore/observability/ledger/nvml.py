"""NVML sampler per learner GPU (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report): utilization, memory, power, SM clock.

A daemon thread samples every `interval_s` onto a timeline; each sample carries both
`time.perf_counter()` and `time.time()` so it lines up with the release trace. Devices are
mapped by UUID (torch's CUDA index order can differ from NVML's, e.g. under
CUDA_VISIBLE_DEVICES). Without NVML or a GPU the sampler is `enabled: False` with the reason,
and every method still works.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["NvmlSampler", "torch_device_uuids", "load_nvml"]


def load_nvml() -> tuple[ModuleType | None, str | None]:
    """(initialized pynvml module, None) or (None, why not)."""
    try:
        import pynvml
    except ImportError as e:
        return None, f"pynvml not importable: {e}"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        return None, f"{type(e).__name__}: {e}"
    return pynvml, None


def torch_device_uuids(indices: Sequence[int] | None = None) -> list[tuple[int, str]]:
    """[(torch CUDA index, NVML UUID)] for `indices` (default: this rank's current device)."""
    import torch

    if not torch.cuda.is_available():
        return []
    if indices is None:
        indices = [torch.cuda.current_device()]
    out = []
    for i in indices:
        uuid = str(torch.cuda.get_device_properties(i).uuid)
        # why: torch prints the bare UUID; NVML wants the "GPU-" (or "MIG-") prefixed form
        out.append((i, uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid))
    return out


def _try(fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported on some boards / fields
        return None


def _stats(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    return (sum(vals) / len(vals), max(vals)) if vals else (None, None)


class NvmlSampler:
    """Background NVML timeline of the given learner GPUs.

    `devices`: torch CUDA indices (default: the current device); `uuids`: NVML UUIDs directly
    (skips torch). `nvml`: an initialized pynvml-like module (tests inject a fake one).
    """

    def __init__(
        self,
        devices: Sequence[int] | None = None,
        *,
        interval_s: float = 0.1,
        uuids: Sequence[str] | None = None,
        nvml: ModuleType | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.reason: str | None = None
        self._handles: list[tuple[str, str, Any]] = []  # (label, uuid, handle)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._nvml, self.reason = (nvml, None) if nvml is not None else load_nvml()
        if self._nvml is None:
            return
        pairs = [(str(i), u) for i, u in enumerate(uuids)] if uuids is not None else [
            (str(i), u) for i, u in torch_device_uuids(devices)
        ]  # fmt: skip
        if not pairs:
            self.reason = "no CUDA device visible to torch"
            return
        try:
            for label, uuid in pairs:
                self._handles.append((label, uuid, self._nvml.nvmlDeviceGetHandleByUUID(uuid)))
        except Exception as e:
            self._handles, self.reason = [], f"{type(e).__name__}: {e} (uuid {uuid})"

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------------ sampling

    def sample_once(self) -> list[dict]:
        """One sample per device, appended to the timeline (no-op when disabled)."""
        nv = self._nvml
        rows = []
        for label, uuid, h in self._handles:
            t_perf, t_wall = time.perf_counter(), time.time()
            util = _try(nv.nvmlDeviceGetUtilizationRates, h)
            mem = _try(nv.nvmlDeviceGetMemoryInfo, h)
            power_mw = _try(nv.nvmlDeviceGetPowerUsage, h)
            energy_mj = _try(nv.nvmlDeviceGetTotalEnergyConsumption, h)
            rows.append({
                "t_perf": t_perf,
                "t_wall": t_wall,
                "device": label,
                "uuid": uuid,
                "util_gpu": None if util is None else util.gpu,
                "util_mem": None if util is None else util.memory,
                "mem_used_bytes": None if mem is None else int(mem.used),
                "power_w": None if power_mw is None else power_mw / 1000.0,
                "sm_clock_mhz": _try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                "energy_j": None if energy_mj is None else energy_mj / 1000.0,
            })  # fmt: skip
        with self._lock:
            self.samples.extend(rows)
        return rows

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def start(self) -> "NvmlSampler":
        if not self.enabled or self._thread is not None:
            return self
        self._stop.clear()
        self.sample_once()  # why: an energy reading at the start of the window
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample_once()  # and one at its end

    def __enter__(self) -> "NvmlSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ reporting

    def timeline(self) -> list[dict]:
        with self._lock:
            return list(self.samples)

    def summary(self) -> dict:
        """Metrics dict: enabled, reason, per-device means/max, energy_j over the window."""
        out: dict = {"enabled": self.enabled, "reason": self.reason,
                     "interval_s": self.interval_s, "devices": {}, "energy_j": None}  # fmt: skip
        rows = self.timeline()
        out["n_samples"] = len(rows)
        total: float | None = None
        for label, uuid, _ in self._handles:
            mine = [r for r in rows if r["device"] == label]
            d: dict = {"uuid": uuid, "n_samples": len(mine)}
            for key in ("util_gpu", "util_mem", "mem_used_bytes", "power_w", "sm_clock_mhz"):
                d[f"{key}_mean"], d[f"{key}_max"] = _stats([r[key] for r in mine])
            energy = [r["energy_j"] for r in mine if r["energy_j"] is not None]
            d["energy_j"] = energy[-1] - energy[0] if len(energy) >= 2 else None
            if d["energy_j"] is not None:
                total = (total or 0.0) + d["energy_j"]
            if mine:
                d["t_first_perf"], d["t_last_perf"] = mine[0]["t_perf"], mine[-1]["t_perf"]
            out["devices"][label] = d
        out["energy_j"] = total
        return out
