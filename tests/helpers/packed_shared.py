"""Shared by the tests of packed: tests/unit/test_packed.py, tests/integration/test_packed.py."""

from __future__ import annotations


VOCAB = 256
