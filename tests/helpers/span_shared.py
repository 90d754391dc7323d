"""Shared by the tests of span: tests/unit/test_span.py, tests/integration/test_model.py (TP=2),
tests/unit/test_attention.py, tests/unit/test_span_te.py."""

from __future__ import annotations

import importlib.util
import os

from tests.helpers.paths import WORKERS


WORKER = os.path.join(WORKERS, "span_worker.py")
_spec = importlib.util.spec_from_file_location("span_worker", WORKER)
sw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sw)


# fp64: the spans and the full forward share megatron's RoPE tables (fp32 cos/sin, equal
# bit for bit for offset positions), so only summation order differs: measured ~3e-15.
FP64_FWD, FP64_GRAD = 1e-12, 1e-12
FP32_FWD, FP32_GRAD = 1e-5, 1e-5
NO_REPLAY_MIN = 1e-2  # the gradient without the replay is 50-65 % off
