"""The OpenAI endpoint's request validation: a body's sampling and streaming parameters,
checked, each refusal an `ApiError` (OpenAI's error object, one line). No web framework
here: the agent pool's hand-outs raise the same errors."""

from __future__ import annotations

import math


class ApiError(Exception):
    """An OpenAI error object: HTTP `status`, a one-line `message`, its type and param."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def number(body: dict, key: str, default: float | None, lo: float, hi: float,
           lo_open: bool = False) -> float | None:
    """body[key], a finite number in [lo, hi] (or (lo, hi]); `default` when absent."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(400, f"{key} must be a number in {'(' if lo_open else '['}{lo}, {hi}], "
                            f"got {v!r}", param=key)
    return float(v)


# A sampling seed, as vLLM's OpenAI server bounds it (a 64-bit signed integer; past it
# vLLM's generator overflows); negative seeds are refused here, as always
SEED_MAX = 2**63 - 1


def integer(body: dict, key: str, lo: int = 0, hi: int | None = None) -> int | None:
    """body[key], an integer in [lo, hi]; None when absent."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        got = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"an integer of " \
            f"{len(str(abs(v)))} digits"
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{key} must be an integer {bound}, got {got}"[:300], param=key)
    return v


MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_TEMPLATE_KWARGS = 16
# apply_chat_template's own parameters: the server sets them, a request may not
_TEMPLATE_OWN = {"conversation", "messages", "tools", "documents", "chat_template",
                 "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                 "truncation", "max_length", "return_tensors", "return_dict",
                 "return_assistant_tokens_mask", "tokenizer_kwargs"}


def template_kwargs(body: dict) -> dict | None:
    """vLLM's `chat_template_kwargs` (e.g. {"enable_thinking": false} for Qwen3): an object
    of at most MAX_TEMPLATE_KWARGS identifier keys with scalar values, none of them a
    parameter the server sets itself."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return None
    what = "chat_template_kwargs"
    if not isinstance(v, dict) or len(v) > MAX_TEMPLATE_KWARGS:
        raise ApiError(400, f"{what} must be an object of at most {MAX_TEMPLATE_KWARGS} "
                            f"entries", param=what)
    for k, x in v.items():
        if not (isinstance(k, str) and k.isidentifier() and len(k) <= 64) or k in _TEMPLATE_OWN:
            raise ApiError(400, f"{what}: {str(k)[:64]!r} is not a template variable a "
                                f"request may set", param=what)
        if not (x is None or isinstance(x, (bool, int, float)) or
                isinstance(x, str) and len(x) <= 1024):
            raise ApiError(400, f"{what}.{k} must be a boolean, number, null or a string of "
                                f"at most 1024 characters", param=what)
    return dict(v) or None


def stop_strings(body: dict) -> list[str]:
    """The request's stop strings; "" and [] (sent by some clients) mean none."""
    stop = body.get("stop")
    if stop in (None, "", []):
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(x, str) and x for x in stop):
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOP} non-empty "
                            f"strings, got {stop!r}", param="stop")
    return stop


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest stop string (excluded); whether one was found."""
    at = min((i for i in (text.find(x) for x in stop) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def stream_flags(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise ApiError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true",
                       param="stream_options")
    usage = opts.get("include_usage", False) if isinstance(opts, dict) else None
    if usage not in (True, False):
        raise ApiError(400, 'stream_options must be {"include_usage": true|false}',
                       param="stream_options")
    return True, usage


# A tokenizer normalizer (Unicode NFC/NFKC, lowercasing) may shrink a text before it is
# cut into tokens: at most 4 bytes become 1 (NFKC of a 4-byte mathematical letter)
NORMALIZER_SHRINK = 4


def token_bytes_ceiling(tok) -> int:
    """The most bytes of prompt text one token of `tok` can stand for: its vocabulary's
    longest token (byte-level BPE spells each byte as one character; other vocabularies
    are counted in UTF-8, which never undercounts), times NORMALIZER_SHRINK when the
    tokenizer normalizes its input. A text of more than n × this many bytes is more than
    n tokens, whatever it says."""
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = tok.get_vocab()
    special = set(getattr(tok, "added_tokens_encoder", {}))
    decoder = repr(getattr(backend, "decoder", None))
    byte_level = "ByteLevel" in decoder
    most = max((len(t) if byte_level and t not in special else len(t.encode("utf-8"))
                for t in vocab), default=1)
    shrink = NORMALIZER_SHRINK if getattr(backend, "normalizer", None) is not None else 1
    return max(1, most) * shrink
