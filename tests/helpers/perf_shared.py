"""Rows of a perf result document that the unit and integration tests of perf/bench/check.py share."""

from __future__ import annotations


def cell_row(schedule: str, measured: float, predicted: float) -> dict:
    return {"objective": "grpo", "schedule": schedule, "ratio": 2.0, "batch": 64,
            "step_time_s": 10.0 / measured, "speedup_measured": measured,
            "speedup_predicted": predicted, "mfu_active": 0.3}  # fmt: skip


def kernel_row(name: str, impl: str, time_s: float, bytes_per_s: float | None = None) -> dict:
    return {"name": name, "impl": impl, "shape": {"numel": 1024}, "time_s": time_s,
            "peak_mem_bytes": 0, "bytes_per_s": bytes_per_s}  # fmt: skip


def result_doc() -> dict:
    return {
        "machine": "test-box",
        "date": "2025-01-01",
        "overlap": [cell_row("thundersync", 1.8, 2.0), cell_row("group_ready", 1.3, 1.4)],
        "kernels": [
            kernel_row("stream_bandwidth", "copy_", 1.0, 100.0),
            kernel_row("accumulate_g1g2", "plain", 2.0, 40.0),
            kernel_row("accumulate_g1g2", "fused-triton", 1.0, 80.0),
        ],
    }
