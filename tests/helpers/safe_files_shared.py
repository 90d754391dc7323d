"""Shared by the tests of safe files: tests/unit/test_safe_files.py,
tests/integration/test_safe_files.py."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture
def model_copy(tiny_ckpts, tmp_path):
    """Copy of a tiny model dir: name -> path (sharded: llama_tied)."""
    def copy(name: str) -> str:
        out = str(tmp_path / name)
        shutil.copytree(tiny_ckpts[name], out)
        return out
    return copy


def truncate(path: str, keep: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))
