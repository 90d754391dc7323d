"""Shared by the tests of model: tests/unit/test_model.py, tests/integration/test_model.py."""

from __future__ import annotations


FP32_TOL = 1e-5
