"""Replay files are untrusted input: every bad line is refused up front, before any model
is built, with one `FILE:LINE: problem` message — never a traceback or a silent run.

Fast: the line validator is pure (tsync_mcore.learner.replay.batches_from_lines); the CLI tests stop
before the model is built.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.batchgen import write_batches
from tests.helpers.paths import ROOT
from tests.helpers.replay_fuzz_shared import (  # noqa: F401  (shared with the unit tests)
    GRPO,
    VOCAB,
    json_line,
    write_lines,
)


def _cli(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")  # megatron's import warnings are not ours
    return subprocess.run([sys.executable, "-m", "tsync_mcore.learner.replay", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["bad_line", "bad_out"])
def test_cli_prints_one_error_line_and_writes_nothing(tmp_path, case):
    out = tmp_path / "out"
    if case == "bad_line":
        batch = write_lines(tmp_path, [GRPO[0], dict(GRPO[1], ready_ordr=3)], "bad.jsonl")
        want = f"{batch}:2: "
    else:
        batch = str(tmp_path / "good.jsonl")
        write_batches(batch, VOCAB, seed=1)
        out.write_text("not a dir")
        want = "--out"
    p = _cli("--model", "/nonexistent-model", "--batch", batch, "--out", str(out))
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], p.stderr
    assert p.stdout == ""
    if case == "bad_line":
        assert not out.exists()
    else:
        assert out.read_text() == "not a dir"
