"""Reading files the learner did not write itself in this process, without trusting them.

Every reader here raises `BadFile` with one line naming the path and the problem; none of
them runs code from the file (JSON and safetensors only, never pickle).
"""

from __future__ import annotations

import json
import os
import stat
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open  # Rust, no torch: the launchers' checks

if TYPE_CHECKING:  # torch only where tensors are read: a launcher checks paths without it
    import torch

MAX_JSON_BYTES = 16 << 20  # config.json / meta.json / index files are small


class BadFile(ValueError):
    """A file (or directory) that cannot be used; the message names it and why."""


def regular_file(path: str, follow_symlinks: bool = False) -> os.stat_result:
    """lstat of `path`, which must be a regular file (a symlink is not followed, unless
    `follow_symlinks`: then a symlink to a regular file is one)."""
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        raise BadFile(f"{path}: missing") from None
    except OSError as e:
        raise BadFile(f"{path}: cannot stat ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadFile(f"{path}: not a regular file")
    return st


def private_dir(path: str) -> str:
    """`path` as a directory only its owner can enter (0700): created so, or tightened when
    this user owns it. The run directory holds the channel secret's neighbours, logs,
    records and weights; the sandboxed tools run as another user and must not read them."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    return path


def read_json(path: str, *, follow_symlinks: bool = True, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parsed JSON of a small file; a broken, huge or unreadable one is a `BadFile`."""
    if not follow_symlinks:
        regular_file(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise BadFile(f"{path}: missing") from None
    except OSError as e:
        raise BadFile(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) > max_bytes:
        raise BadFile(f"{path}: larger than {max_bytes} bytes")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise BadFile(f"{path}: not valid JSON ({_first_line(e)})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_json_object(path: str, **kw) -> dict:
    obj = read_json(path, **kw)
    if not isinstance(obj, dict):
        raise BadFile(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def safetensors_header(path: str) -> tuple[list[str], dict[str, str]]:
    """Tensor names and string metadata of a safetensors file. Opening parses and checks the
    header (offsets must cover the file exactly), so a truncated file is refused here."""
    try:
        with safe_open(path, "pt") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except FileNotFoundError:
        raise BadFile(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise BadFile(f"{path}: not a readable safetensors file ({_first_line(e)})") from None


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors (CPU) and the string metadata of a safetensors file."""
    try:
        with safe_open(path, "pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except FileNotFoundError:
        raise BadFile(f"{path}: missing") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise BadFile(f"{path}: not a readable safetensors file ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else type(e).__name__


# --------------------------------------------------------------------------- HF model dirs


class ModelDirError(BadFile):
    """A Hugging Face model directory that cannot be loaded; the message names the file."""


def hf_config(hf_dir: str) -> dict:
    """config.json of an HF model directory, parsed."""
    if not os.path.isdir(hf_dir):
        raise ModelDirError(f"model directory {hf_dir or repr(hf_dir)}: missing or not a "
                            f"directory")
    try:
        return read_json_object(os.path.join(hf_dir, "config.json"))
    except BadFile as e:
        raise ModelDirError(str(e)) from None


def hf_weight_map(hf_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file name of an HF model directory (sharded or not). Every
    file's header is checked here, so a truncated shard fails before anything is built."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    try:
        if os.path.exists(index):
            wm = read_json_object(index).get("weight_map")
            if not (isinstance(wm, dict) and wm and all(
                    isinstance(k, str) and isinstance(v, str) and v == os.path.basename(v)
                    and v.endswith(".safetensors") and not v.startswith(".")
                    for k, v in wm.items())):
                raise ModelDirError(f"{index}: weight_map must map tensor names to "
                                    f"*.safetensors file names in the same directory")
            for fname in sorted(set(wm.values())):
                names, _ = safetensors_header(os.path.join(hf_dir, fname))
                absent = [k for k, v in wm.items() if v == fname and k not in set(names)]
                if absent:
                    raise ModelDirError(f"{os.path.join(hf_dir, fname)}: lacks {absent[0]!r} "
                                        f"listed in {index}")
            return wm
        single = os.path.join(hf_dir, "model.safetensors")
        if not os.path.exists(single):
            raise ModelDirError(f"model directory {hf_dir}: no model.safetensors(.index.json)")
        names, _ = safetensors_header(single)
        return {k: "model.safetensors" for k in names}
    except ModelDirError:
        raise
    except BadFile as e:
        raise ModelDirError(str(e)) from None


def check_hf_dir(hf_dir: str) -> None:
    """Up-front check of a directory another library (vLLM, transformers) will load."""
    hf_config(hf_dir)
    hf_weight_map(hf_dir)
