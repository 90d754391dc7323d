"""Shared by the tests of replay fuzz: tests/unit/test_replay_fuzz.py,
tests/integration/test_replay_fuzz.py."""

from __future__ import annotations

import json

from tests.helpers.batchgen import make_batch


VOCAB = 256
GRPO = make_batch(VOCAB, n_groups=2, m=3, seed=5)


def json_line(x) -> bytes:
    return x if isinstance(x, bytes) else json.dumps(x).encode()


def write_lines(tmp_path, rows, name="b.jsonl") -> str:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(b"".join(json_line(r) + b"\n" for r in rows))
    return path
