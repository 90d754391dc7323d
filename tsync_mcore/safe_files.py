"""Reading files the learner did not write itself in this process, without trusting them.

Every reader here raises `BadFile` with one line naming the path and the problem; none of
them runs code from the file (JSON and safetensors only, never pickle).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

MAX_JSON_BYTES = 16 << 20  # config.json / meta.json / index files are small


class BadFile(ValueError):
    """A file (or directory) that cannot be used; the message names it and why."""


def regular_file(path: str) -> os.stat_result:
    """lstat of `path`, which must be a regular file (a symlink is not followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise BadFile(f"{path}: missing") from None
    except OSError as e:
        raise BadFile(f"{path}: cannot stat ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadFile(f"{path}: not a regular file")
    return st


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
