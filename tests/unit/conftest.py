"""The unit lane's promise, enforced: a test here starts no process (subprocess, fork,
multiprocessing, torchrun) and imports no vLLM. One that does fails, naming the move."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys

import pytest

MOVE = "unit tests {what}: move this test to tests/integration"


class _NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(MOVE.format(what="import no vLLM"))
        return None


@pytest.fixture(autouse=True)
def _pure(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(MOVE.format(what="start no process"))

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    guard = _NoVllm()
    sys.meta_path.insert(0, guard)
    yield
    sys.meta_path.remove(guard)
