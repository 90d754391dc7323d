"""The wire between the rollout and its jailed scorer workers (rewards/jailed.py,
rewards/worker.py): frames of 4 bytes of big-endian length, then that many bytes of UTF-8
JSON, bounded each way (MAX_REQUEST, MAX_RESULT); tuples travel tagged (reasoning-gym
entries hold them)."""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any, BinaryIO

MAX_REQUEST = 8 << 20  # bytes of one call's arguments (prompt, response, messages, ...)
MAX_RESULT = 64 << 10  # bytes of one call's result
HEADER = struct.Struct(">I")
_TUPLE = "__tsync_tuple__"  # reasoning-gym metadata holds tuples; JSON alone makes them lists


class FrameError(RuntimeError):
    """A frame that is too long, cut short or not JSON; the message is one line."""


def encode(obj: Any) -> Any:
    """`obj` with its tuples tagged, so they come back as tuples (reasoning-gym entries
    carry them); TypeError for what JSON cannot hold."""
    if isinstance(obj, tuple):
        return {_TUPLE: [encode(x) for x in obj]}
    if isinstance(obj, list):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"a mapping with a non-string key ({next(k for k in obj if not isinstance(k, str))!r})")
        return {k: encode(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    raise TypeError(f"a {type(obj).__name__}")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    if isinstance(obj, dict):
        if len(obj) == 1 and _TUPLE in obj:
            return tuple(decode(x) for x in obj[_TUPLE])
        return {k: decode(v) for k, v in obj.items()}
    return obj


def dump(obj: Any) -> bytes:
    data = json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()
    return HEADER.pack(len(data)) + data


def write_frame(f: BinaryIO, obj: Any) -> None:
    f.write(dump(obj))
    f.flush()


def read_exact(fd: int, n: int, deadline: float | None = None) -> bytes | None:
    """n bytes from `fd`; None at end of file before the first byte, FrameError when cut
    short; TimeoutError past `deadline` (time.monotonic)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            if buf:
                raise FrameError(f"a frame cut short after {len(buf)} of {n} bytes")
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd: int, limit: int, deadline: float | None = None) -> Any:
    """The next frame's JSON value (None at end of file)."""
    head = read_exact(fd, HEADER.size, deadline)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > limit:
        raise FrameError(f"a frame of {n} bytes (at most {limit})")
    data = read_exact(fd, n, deadline) if n else b""
    if data is None:
        raise FrameError(f"a frame cut short after its header ({n} bytes announced)")
    try:
        return json.loads(data)
    except ValueError as e:
        raise FrameError(f"a frame that is not JSON: {str(e)[:120]}") from None
