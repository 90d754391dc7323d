"""Shared by the tests of lr schedule: tests/unit/test_lr_schedule.py,
tests/integration/test_lr_schedule.py."""

from __future__ import annotations

import math


def reference_lr(k: int, style: str, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    if warmup and k <= warmup:
        return lr * k / warmup
    if style == "constant":
        return lr
    if k >= decay:
        return min_lr
    progress = (k - warmup) / (decay - warmup)
    shape = 1 - progress if style == "linear" else (1 + math.cos(math.pi * progress)) / 2
    return min_lr + (lr - min_lr) * shape
