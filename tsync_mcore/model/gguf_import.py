"""GGUF files (llama.cpp's format) as Hugging Face model directories the bridge loads.

    python -m tsync_mcore.model.gguf_import SRC.gguf OUT_DIR

The file is checked with the `gguf` package first (the magic bytes, a whole and parseable
header, tensor data inside the file, `general.architecture` one the bridge supports:
llama, qwen2, qwen3). transformers then reads it: the config, the tokenizer with its chat
template, and every tensor dequantized to FP32. Every tensor of the file must land in a
parameter of the model and every parameter must come from the file (transformers would
drop the one and initialise the other at random). The model is rebuilt from that config
without the GGUF loading state and written with `save_pretrained` (safetensors, FP32),
beside the tokenizer, `generation_config.json` and, last, `gguf_import.json` (the source's
name and sha256, the files written).

A refusal is one line `error: <path>: <why>` on stderr and exit status 2, and nothing is
written: OUT_DIR must be absent or empty (not a symlink); the directory is built under a
temporary name beside it and renamed into place when complete. An OUT_DIR that already
holds this file's conversion is left as it is (`ok: OUT_DIR (already converted)`, exit 0),
so make can call this unconditionally. No pickle is read: GGUF in, safetensors out.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from tsync_mcore.util.safe_files import BadFile, check_hf_dir, read_json_object, regular_file

__all__ = ["ARCHS", "MARKER", "GGUFImportError", "check_out_dir", "converted", "import_gguf",
           "main", "read_gguf", "sha256"]

# GGUF architecture -> HF model_type: the dense ones tsync_mcore/model/bridge/spec.py supports.
# (qwen3moe is left out: transformers fuses its experts, and the tensor check below maps
# names one to one.)
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
MARKER = "gguf_import.json"  # written last: a directory holding it is a finished conversion
MAGIC = b"GGUF"
# Text the saved tokenizer must encode as the GGUF's does: contractions, digits after spaces,
# runs of spaces and newlines, accents (NFC), other scripts
PROBE = "Hello, world! It's 2 + 3 = 5; I'm 12 345 6789 café ÜBER ✓ 日本語\n\t  two  spaces\r\n"
GGUF_NAME = "model.gguf"  # the source's name inside the private directory transformers reads


class GGUFImportError(BadFile):
    """A GGUF file or output directory that cannot be used; the message names it and why."""


@dataclass(frozen=True)
class GGUFHeader:
    """What the importer needs from a GGUF file's metadata."""

    path: str
    arch: str
    name: str | None  # general.name
    layers: int
    tensors: tuple[str, ...]


# --------------------------------------------------------------------------- the source


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else type(e).__name__


def _check_source(path: str) -> os.stat_result:
    """A regular file (a symlink to one is fine) that starts with the GGUF magic bytes."""
    try:
        st = regular_file(path, follow_symlinks=True)
    except BadFile as e:
        raise GGUFImportError(str(e)) from None
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise GGUFImportError(f"{path}: cannot read ({e.strerror})") from None
    if head != MAGIC:
        raise GGUFImportError(f"{path}: not a GGUF file (starts with {head!r}, not {MAGIC!r})")
    return st


def _field(reader, key: str, path: str):
    field = reader.fields.get(key)
    if field is None:
        raise GGUFImportError(f"{path}: no {key} in the GGUF metadata")
    try:
        return field.contents()
    except Exception as e:  # a damaged value; gguf's errors vary
        raise GGUFImportError(f"{path}: unreadable {key} ({_first_line(e)})") from None


def read_gguf(path: str) -> GGUFHeader:
    """The header of the GGUF file at `path`, after checking that it is one, whole, of an
    architecture the bridge supports. Raises GGUFImportError."""
    import gguf

    st = _check_source(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # a short file fails in numpy's views, with varying errors
        raise GGUFImportError(f"{path}: truncated or damaged GGUF file ({_first_line(e)})") \
            from None
    arch = _field(reader, "general.architecture", path)
    if arch not in ARCHS:
        raise GGUFImportError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHS)})")
    for t in reader.tensors:  # the reader maps what it can; a tensor past the end is cut off
        if t.data_offset + t.n_bytes > st.st_size:
            raise GGUFImportError(f"{path}: truncated (tensor {t.name} ends at byte "
                                  f"{t.data_offset + t.n_bytes}, the file has {st.st_size})")
    layers = _field(reader, f"{arch}.block_count", path)
    name = _field(reader, "general.name", path) if "general.name" in reader.fields else None
    return GGUFHeader(path=path, arch=arch, name=name, layers=int(layers),
                      tensors=tuple(t.name for t in reader.tensors))


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --------------------------------------------------------------------------- the output


def converted(out_dir: str) -> dict | None:
    """The marker of a finished conversion in `out_dir` (every file it lists present, the
    weights' headers readable), or None."""
    if os.path.islink(out_dir) or not os.path.isdir(out_dir):
        return None
    try:
        marker = read_json_object(os.path.join(out_dir, MARKER), follow_symlinks=False)
        files = marker.get("files")
        if not isinstance(files, list) or not isinstance(marker.get("sha256"), str):
            return None
        for name in files:
            if not isinstance(name, str) or name != os.path.basename(name) or \
                    not os.path.isfile(os.path.join(out_dir, name)):
                return None
        check_hf_dir(out_dir)
    except BadFile:
        return None
    return marker


def check_out_dir(out: str) -> None:
    """`out` can be written: absent or an empty directory, not a symlink, under a writable
    ancestor. Raises GGUFImportError."""
    if os.path.islink(out):
        raise GGUFImportError(f"{out}: is a symlink (name the directory itself)")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise GGUFImportError(f"{out}: exists and is not a directory")
        if os.listdir(out):
            raise GGUFImportError(f"{out}: exists and is not empty (nothing was written)")
    probe = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(probe):  # the nearest existing ancestor must be writable
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise GGUFImportError(f"{out}: {probe} is not a writable directory")


# --------------------------------------------------------------------------- the conversion


def _load(src: str):
    """transformers' model (FP32, dequantized) and tokenizer of the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="tsync-gguf-") as alone:
        # the file alone in a directory: a config.json or tokenizer files that happen to lie
        # beside it are not read with it; no hub is asked (local_files_only)
        os.symlink(os.path.abspath(src), os.path.join(alone, GGUF_NAME))
        kw = {"gguf_file": GGUF_NAME, "local_files_only": True}
        try:
            model = AutoModelForCausalLM.from_pretrained(
                alone, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kw)
            tokenizer = AutoTokenizer.from_pretrained(alone, **kw)
        except Exception as e:  # transformers' errors vary; the file is refused either way
            raise GGUFImportError(f"{src}: transformers cannot load it ({type(e).__name__}: "
                                  f"{_first_line(e)})") from None
    return model, tokenizer


def _check_tensors(header: GGUFHeader, model) -> None:
    """Each GGUF tensor is one parameter of the model and each parameter one GGUF tensor,
    by the gguf package's own name table (the one transformers maps with)."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == header.arch)
    names = gguf.get_tensor_name_map(arch, header.layers)
    expected: dict[str, str] = {}  # GGUF name -> HF name
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # no output.weight in the file is what made transformers tie them
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise GGUFImportError(f"{header.path}: no GGUF tensor name for the model's "
                                  f"{hf_name}")
        expected[f"{gguf_name}.{suffix}"] = hf_name
    have = set(header.tensors)
    extra = [t for t in header.tensors if t not in expected]
    if extra:
        raise GGUFImportError(f"{header.path}: tensor {extra[0]!r} has no place in the "
                              f"{header.arch} model" + _more(extra))
    absent = [g for g in expected if g not in have]
    if absent:
        raise GGUFImportError(f"{header.path}: no tensor {absent[0]!r} (the model's "
                              f"{expected[absent[0]]})" + _more(absent))


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _rebuild(gguf_model):
    """The same model without the GGUF loading state, to be saved: built from the config on
    the meta device (no second copy, no random init) and given the dequantized tensors.
    Buffers computed at init (rotary inv_freq) stay on meta: they are not saved."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(gguf_model.config)
    for key in ("quantization_config", "_model_name_or_path"):  # loading state, not the model
        cfg.__dict__.pop(key, None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    model.tie_weights()
    return model


def _write(src: str, header: GGUFHeader, digest: str, out: str) -> None:
    """Load, check, rebuild, save into a temporary directory beside `out`, rename."""
    import transformers

    gguf_model, tokenizer = _load(src)
    _check_tensors(header, gguf_model)
    model = _rebuild(gguf_model)
    del gguf_model

    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # an ordinary directory, not mkdtemp's 0700
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _generic_tokenizer_class(tmp)
        _check_tokenizer(src, tokenizer, tmp)
        files = sorted(os.listdir(tmp))
        for name in files:  # safetensors writes 0600; the directory's mode decides access
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        marker = {"source": os.path.basename(src), "sha256": digest, "architecture": header.arch,
                  "name": header.name, "dtype": "float32", "files": files,
                  "transformers": transformers.__version__,
                  "gguf": _version("gguf")}
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.write("\n")
        os.chmod(os.path.join(tmp, MARKER), 0o666 & ~umask)
        os.rename(tmp, out)  # onto an absent or empty directory: atomic
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _generic_tokenizer_class(tmp: str) -> None:
    """tokenizer.json holds the pipeline the GGUF describes, and the generic class loads it
    as it is; a model family's class (Qwen2Tokenizer: NFC, its own split regex) is rebuilt
    from the class's defaults instead. (AutoTokenizer still picks Qwen2Tokenizer for
    model_type qwen2 whatever the file says: `_check_tokenizer` catches a difference.)"""
    path = os.path.join(tmp, "tokenizer_config.json")
    cfg = read_json_object(path)
    cfg["tokenizer_class"] = "TokenizersBackend"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _check_tokenizer(src: str, tokenizer, tmp: str) -> None:
    """The saved tokenizer, loaded back, encodes a probe text and the special tokens as the
    GGUF's does."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    for text in (PROBE, "".join(tokenizer.all_special_tokens)):
        if saved(text).input_ids != tokenizer(text).input_ids:
            raise GGUFImportError(f"{src}: the saved tokenizer encodes {text[:40]!r} unlike the "
                                  f"GGUF's ({type(saved).__name__})")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def convert(gguf_path: str, out_dir: str) -> bool:
    """Convert `gguf_path` into `out_dir`; False when `out_dir` already held its conversion.
    Raises GGUFImportError (a BadFile) or OSError, with nothing written."""
    _check_source(gguf_path)
    digest = sha256(gguf_path)
    done = converted(out_dir)
    if done is not None:
        if done["sha256"] == digest:
            return False
        raise GGUFImportError(f"{out_dir}: holds the conversion of another file "
                              f"({done.get('source')}, sha256 {done['sha256'][:12]}…), not of "
                              f"{gguf_path} (nothing was written)")
    header = read_gguf(gguf_path)
    check_out_dir(out_dir)
    _write(gguf_path, header, digest, out_dir)
    return True


def import_gguf(gguf_path: str, out_dir: str) -> str:
    """`out_dir` holding the Hugging Face conversion of the GGUF file `gguf_path` (made
    now, or found there already); returns `out_dir`."""
    convert(gguf_path, out_dir)
    return out_dir


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.model.gguf_import",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC.gguf", help="the GGUF file (llama, qwen2 or qwen3)")
    p.add_argument("out", metavar="OUT_DIR",
                   help="the Hugging Face directory to write: absent, empty, or this file's "
                        "conversion already")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        fresh = convert(args.src, args.out)
    except (BadFile, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if fresh:
        print(f"ok: {args.out} (converted from {args.src} in "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
    else:
        print(f"ok: {args.out} (already converted)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
