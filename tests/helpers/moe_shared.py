"""Shared by the tests of moe: tests/unit/test_moe.py, tests/integration/test_moe.py."""

from __future__ import annotations


FP32_TOL = 1e-5
