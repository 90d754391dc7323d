"""Shared by the tests of sandbox tools: tests/unit/test_sandbox_tools.py,
tests/integration/test_sandbox_tools.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tok():
    from tsync_mcore.model.tiny import _build_tokenizer

    return _build_tokenizer(256)
