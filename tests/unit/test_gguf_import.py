"""GGUF import (tsync_mcore/model/gguf_import.py): tiny random GGUF files written with the
gguf package, converted; the converted model's logits equal transformers' GGUF-loaded
model's exactly and its tokenizer encodes alike; every bad input is one line on stderr and
exit status 2, with nothing written."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from tests.helpers.tiny_gguf import write_tiny_gguf
from tsync_mcore.model import gguf_import
from tsync_mcore.model.tiny import CHAT_TEMPLATE

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tie=True, seed=1),
    "qwen2": dict(arch="qwen2", seed=2),  # QKV biases
    "qwen3_tied": dict(arch="qwen3", tie=True, seed=3),  # qk-norm, head_dim 128
}
TEXTS = ["What is 2 + 3? The answer is 5.", "def add(a, b):\n    return a + b",
         "<|im_start|>user\nHi<|im_end|>\n", " leading space, ÜNICODE ✓ and 0123456789"]


def _gguf_loaded(src: str):
    """transformers' own reading of the GGUF file: model (FP32) and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(src)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(d, gguf_file=name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_model_equals_the_gguf_loaded_one(variant, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tsync_mcore.model.bridge.spec import ModelSpec

    (tmp_path / "src").mkdir()  # the GGUF alone in its directory, as transformers reads it
    src = write_tiny_gguf(str(tmp_path / "src" / "tiny.gguf"), **VARIANTS[variant])
    out = gguf_import.import_gguf(src, str(tmp_path / "hf"))
    assert out == str(tmp_path / "hf")
    files = sorted(os.listdir(out))
    assert "model.safetensors" in files and gguf_import.MARKER in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl"))]

    ref, ref_tok = _gguf_loaded(src)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    spec = ModelSpec.from_hf_config(cfg)  # the bridge takes it
    assert spec.arch == VARIANTS[variant]["arch"] and spec.tie == variant.endswith("_tied")
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads) == (2, 64, 4, 2)

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, spec.vocab_size, (1, 7), generator=gen),
               torch.randint(0, spec.vocab_size, (3, 41), generator=gen),
               ref_tok(TEXTS[0], return_tensors="pt").input_ids]
    with torch.no_grad():
        for ids in batches:
            a, b = ref(ids).logits, hf(ids).logits
            assert a.abs().max() > 0.1  # not flat: the weights reach the logits
            assert torch.equal(a, b)
    for name, t in hf.state_dict().items():
        assert torch.equal(t, ref.state_dict()[name]), name

    for text in TEXTS:
        assert tok(text).input_ids == ref_tok(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == ref_tok.decode(ref_tok(text).input_ids)
    assert tok.chat_template == ref_tok.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "What is 7 * 6?"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == \
        (ref_tok.eos_token, ref_tok.pad_token, ref_tok.bos_token) == \
        ("<|im_end|>", "<|endoftext|>", "<|im_start|>")


def test_bridge_archs_are_a_subset():
    from tsync_mcore.model.bridge import spec

    assert set(gguf_import.ARCHS.values()) <= set(spec._ARCHS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_gguf")
    return write_tiny_gguf(str(d / "tiny.gguf"), "llama", tie=True)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = gguf_import.main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_cli_converts_once_then_says_already_converted(tiny, tmp_path, capsys):
    out = str(tmp_path / "models" / "hf")  # missing parents are made
    code, so, se = _run(capsys, tiny, out)
    assert code == 0 and so.startswith(f"ok: {out} (converted from {tiny} in ")
    assert len(so.splitlines()) == 1
    marker = gguf_import.converted(out)
    assert marker["sha256"] == gguf_import.sha256(tiny) and marker["architecture"] == "llama"
    mtimes = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    code, so, se = _run(capsys, tiny, out)
    assert (code, so, se) == (0, f"ok: {out} (already converted)\n", "")
    assert mtimes == {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    assert sorted(os.listdir(tmp_path / "models")) == ["hf"]  # no temporary left beside it
    modes = {f: os.stat(os.path.join(out, f)).st_mode for f in os.listdir(out)}
    assert len(set(modes.values())) == 1, modes  # the weights too, not safetensors' 0600


def _one_line_error(capsys, src: str, out: str, expected: str | None = None) -> str:
    code, so, se = _run(capsys, src, out)
    assert code == 2 and so == ""
    assert se.endswith("\n") and len(se.splitlines()) == 1, se
    assert se.startswith("error: ") and "Traceback" not in se
    if expected is not None:
        assert se == f"error: {expected}\n"
    return se


def test_missing_file(tmp_path, capsys):
    src = str(tmp_path / "nope.gguf")
    _one_line_error(capsys, src, str(tmp_path / "hf"), f"{src}: missing")
    assert not os.path.exists(tmp_path / "hf")


def test_not_a_gguf(tmp_path, capsys):
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    se = _one_line_error(capsys, str(src), str(tmp_path / "hf"))
    assert se.startswith(f"error: {src}: not a GGUF file (starts with b'\\x08")
    (tmp_path / "dir.gguf").mkdir()
    _one_line_error(capsys, str(tmp_path / "dir.gguf"), str(tmp_path / "hf"),
                    f"{tmp_path / 'dir.gguf'}: not a regular file")
    assert sorted(os.listdir(tmp_path)) == ["dir.gguf", "model.safetensors"]


@pytest.mark.parametrize("keep", [3, 30, 2000, "half", "all but 1"])
def test_truncated(tiny, tmp_path, capsys, keep):
    with open(tiny, "rb") as f:
        data = f.read()
    n = {"half": len(data) // 2, "all but 1": len(data) - 1}.get(keep, keep)
    src = tmp_path / "cut.gguf"
    src.write_bytes(data[:n])
    se = _one_line_error(capsys, str(src), str(tmp_path / "hf"))
    if n < 4:
        assert se.startswith(f"error: {src}: not a GGUF file")
    else:
        assert se.startswith(f"error: {src}: truncated")
    assert sorted(os.listdir(tmp_path)) == ["cut.gguf"]


def test_unsupported_architecture(tmp_path, capsys):
    import gguf
    import numpy as np

    src = str(tmp_path / "mamba.gguf")
    w = gguf.GGUFWriter(src, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(capsys, src, str(tmp_path / "hf"),
                    f"{src}: GGUF architecture 'mamba' is not supported (supported: llama, "
                    f"qwen2, qwen3)")
    assert not os.path.exists(tmp_path / "hf")


def test_out_dir_refusals(tiny, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    _one_line_error(capsys, tiny, str(full),
                    f"{full}: exists and is not empty (nothing was written)")
    assert os.listdir(full) == ["notes.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "link"
    link.symlink_to(empty)
    _one_line_error(capsys, tiny, str(link), f"{link}: is a symlink (name the directory itself)")
    assert os.listdir(empty) == []

    afile = tmp_path / "afile"
    afile.write_text("x")
    _one_line_error(capsys, tiny, str(afile), f"{afile}: exists and is not a directory")

    # another file's conversion is not taken for this one's
    other = write_tiny_gguf(str(tmp_path / "other.gguf"), "qwen2", vocab_size=300)
    done = str(tmp_path / "done")
    gguf_import.import_gguf(other, done)
    capsys.readouterr()
    se = _one_line_error(capsys, tiny, done)
    assert se == f"error: {done}: holds the conversion of another file (other.gguf, sha256 " \
                 f"{gguf_import.sha256(other)[:12]}…), not of {tiny} (nothing was written)\n"
    assert sorted(os.listdir(tmp_path)) == ["afile", "done", "empty", "full", "link",
                                            "other.gguf"]


def test_an_empty_out_dir_is_filled(tiny, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    code, _, _ = _run(capsys, tiny, str(tmp_path / "hf"))
    assert code == 0 and gguf_import.converted(str(tmp_path / "hf")) is not None


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_every_tensor_has_its_place(tmp_path, capsys, change):
    """A tensor transformers would drop, or a parameter it would initialise at random."""
    import gguf

    src = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(src, "llama")
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(tmp_path / "edited.gguf"), "llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in r.tensors:
        if change == "missing" and t.name == "blk.1.ffn_up.weight":
            continue
        w.add_tensor(t.name, t.data.copy())  # the reader's view has the numpy shape
    if change == "extra":
        w.add_tensor("rope_freqs.weight", torch.ones(8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    edited = str(tmp_path / "edited.gguf")
    code, _, se = _run(capsys, edited, str(tmp_path / "hf"))
    errors = [ln for ln in se.replace("\r", "\n").splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and se.rstrip("\n").endswith(errors[0]), se
    if change == "extra":
        assert errors[0] == f"error: {edited}: tensor 'rope_freqs.weight' has no place in the " \
                            f"llama model"
    else:
        assert errors[0] == f"error: {edited}: no tensor 'blk.1.ffn_up.weight' (the model's " \
                            f"model.layers.1.mlp.up_proj.weight)"
    assert not os.path.exists(tmp_path / "hf")


def test_a_tokenizer_transformers_would_load_differently_is_refused(tmp_path, capsys):
    """A qwen2 GGUF whose tokenizer does not split as Qwen2's: AutoTokenizer loads any
    model_type qwen2 directory with Qwen2Tokenizer's own split, so the saved directory would
    tokenize unlike the GGUF."""
    src = write_tiny_gguf(str(tmp_path / "gpt2_split.gguf"), "qwen2", pre=None)
    code, _, se = _run(capsys, src, str(tmp_path / "hf"))
    last = se.splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {src}: the saved tokenizer encodes ")
    assert last.endswith("unlike the GGUF's (Qwen2Tokenizer)")
    assert sorted(os.listdir(tmp_path)) == ["gpt2_split.gguf"]


def test_a_failed_write_leaves_nothing(tiny, tmp_path, capsys, monkeypatch):
    def full_disk(a, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), b)

    monkeypatch.setattr(gguf_import.os, "rename", full_disk)
    out = str(tmp_path / "hf")
    code, _, se = _run(capsys, tiny, out)
    monkeypatch.undo()
    assert code == 2 and se.splitlines()[-1].startswith("error: [Errno 28] No space left")
    assert os.listdir(tmp_path) == []
