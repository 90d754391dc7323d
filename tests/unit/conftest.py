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


@pytest.fixture(autouse=True, scope="package")
def _pure():
    """Package scope: set up before any module fixture of the lane, so fixtures are held to
    the promise as well as tests."""
    def refuse(*args, **kwargs):
        raise AssertionError(MOVE.format(what="start no process"))

    guard = _NoVllm()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", refuse)
        mp.setattr(os, "fork", refuse)
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        sys.meta_path.insert(0, guard)
        try:
            yield
        finally:
            sys.meta_path.remove(guard)
