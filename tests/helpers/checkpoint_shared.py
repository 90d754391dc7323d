"""Shared by the tests of checkpoint: tests/unit/test_checkpoint.py,
tests/integration/test_checkpoint.py."""

from __future__ import annotations

import hashlib


def redigest_file(path: str) -> None:
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(path.removesuffix(".safetensors") + ".sha256", "w") as f:
        f.write(digest)


class Touch:
    """Unpickling this creates `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
