"""Message ⇄ tensor codec, derived from the declarations in messages.py.

Pure functions, no processes: `encode(msg)` gives the tensors a link sends in order (an
int64[16] header, then the payloads), `decode(tensors)` checks structure (magic, wire
version, type, payload count, dtypes, sizes within `Limits`, checksums, the type of each
value) and rebuilds the dataclass. `check_header` runs the header part alone, so a receiver
can validate sizes *before* it allocates payload buffers. docs/design/wire.md describes the format;
its table is `schema_table()` (`python -m tsync_mcore.channel --table`).

A message's payloads, in order: one per array field (declaration order), then `ints`
(int64: the scalar int slots, then the byte length of each text), `floats` (float64) and
`text` (the utf-8 texts, concatenated), each present when the type has any.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass
from enum import IntEnum
from operator import attrgetter

import numpy as np
import torch

from tsync_mcore.channel.errors import ChannelError
from tsync_mcore.channel.messages import MESSAGES, Message
from tsync_mcore.channel.schema import At, Kind, Nested, Slots

MAGIC = 0x7473796E63  # b"tsync"
WIRE_VERSION = 12  # 2: payload checksum is position-weighted CRC-32; 3: GroupRewards;
# 4: a message travels as one fixed-size frame (header + payloads), see link.py;
# 5: layout derived from messages.py: scalars packed into one int64 and one float64 payload,
#    texts and JSON into one utf-8 payload (byte lengths in the ints); Rejected, DropGroup;
# 6: TCP links instead of gloo: an authenticated join handshake (handshake.py), and frames
#    sized by their header and sealed with an HMAC-SHA256 (link.py)
# 7: CloseBatch carries the rollout side's metrics (reward extras, errors, evaluation)
# 8: sources carry their behaviour log-probs and per-token policy versions (off-policy)
# 9: publication over torch.distributed: Publish method/n_buckets/delta, Ack checksum and
#    bytes_received, PublishGroup
# 10: Publish method "adapter" (a LoRA adapter's PEFT directory)
# 11: routed_experts on TrajectoryMsg / TurnMsg (MoE routing replay), Limits.max_routed
# 12: TrajectoryMsg segment / n_segments / trajectory_scored (segmented trajectories)
HEADER_LEN = 16
MAX_PAYLOADS = 9  # header slots 5..13
_MOD = 1 << 62  # checksums stay far from int64 overflow

DTYPE_CODES: dict[int, torch.dtype] = {1: torch.int64, 2: torch.uint8, 3: torch.float64}
_CODE_OF = {dt: c for c, dt in DTYPE_CODES.items()}
_TORCH_OF = {np.int64: torch.int64, np.uint8: torch.uint8, np.float64: torch.float64}


def _enum_name(cls: type) -> str:  # TrajectoryMsg → TRAJECTORY, GroupRewards → GROUP_REWARDS
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Msg")).upper()


# The header's type slot; the codes are the declarations' (messages.py).
MsgType = IntEnum("MsgType", [(_enum_name(m), m.WIRE.code) for m in MESSAGES])
MsgType.__doc__ = "Message type codes (header[2]), as messages.py declares them."


@dataclass(frozen=True)
class Limits:
    """Largest payloads a receiver accepts; checked before any buffer is allocated."""

    max_tokens: int = 1 << 20  # per array payload (a trajectory's / turn's tokens)
    max_bytes: int = 64 << 20  # per text payload (all of a message's str / JSON fields)
    # per routed-experts payload (ids, one byte each): rows × MoE layers × top-k; 48 layers
    # × top-8 is 384 per token, so this admits a 700k-token trajectory of such a model
    max_routed: int = 1 << 28


DEFAULT_LIMITS = Limits()

# Payload size rules: an exact element count, or bounded by a Limits field.
TOKENS, BYTES, ROUTED = "tokens", "bytes", "routed"
_LIMIT_OF = {TOKENS: "max_tokens", BYTES: "max_bytes", ROUTED: "max_routed"}
PayloadSpec = tuple[str, torch.dtype, int]  # name, dtype, element count


# ---------------------------------------------------------------- the compiled declaration

@dataclass(frozen=True)
class _Field:
    name: str  # dotted below the message: "source.tokens"
    kind: Kind
    at: At
    where: str  # for errors: "TrajectoryMsg.source.tokens"
    value: attrgetter


class _Spec:
    """One message type's layout, computed once from its declaration."""

    def __init__(self, cls: type):
        self.cls, self.name, self.sender = cls, cls.__name__, cls.WIRE.sender
        self.type = MsgType(cls.WIRE.code)
        self.nested: list[tuple[str, type, int]] = []  # (field, dataclass, number of values)
        leaves: list[tuple[str, Kind]] = []
        for f in dataclasses.fields(cls):
            kind = f.metadata["wire"]
            if isinstance(kind, Nested):
                self.nested.append((f.name, kind.cls, len(kind.fields)))
                leaves += [(f"{f.name}.{k}", sub) for k, sub in kind.fields.items()]
            else:
                self.nested.append((f.name, None, 1))
                leaves.append((f.name, kind))
        self.fields: list[_Field] = []
        i = fl = t = a = 0
        for name, kind in leaves:
            self.fields.append(_Field(name, kind, At(i, fl, t, a), f"{self.name}.{name}",
                                      attrgetter(name)))
            i, fl, t = i + kind.ints, fl + kind.floats, t + kind.texts
            a += kind.array is not None
        if sum(k.header for _, k in leaves) > 1:
            raise TypeError(f"{self.name}: more than one VERSION field")
        self.n_scalars, self.n_ints, self.n_floats, self.n_texts = i, i + t, fl, t
        self.text_names = [n for n, k in leaves for _ in range(k.texts)]
        self.payloads: list[tuple[str, torch.dtype, int | str]] = [
            (n, k.array, k.limit) for n, k in leaves if k.array is not None]
        self.n_arrays = len(self.payloads)
        if self.n_ints:
            self.payloads.append(("ints", torch.int64, self.n_ints))
        if self.n_floats:
            self.payloads.append(("floats", torch.float64, self.n_floats))
        if self.n_texts:
            self.payloads.append((f"text: {', '.join(self.text_names)}", torch.uint8, BYTES))
        if len(self.payloads) > MAX_PAYLOADS:
            raise TypeError(f"{self.name}: {len(self.payloads)} payloads, the header has "
                            f"{MAX_PAYLOADS} slots")
        self.getters = [(f.kind.get, f.where, f.at) for f in self.fields]
        self.flat = all(sub is None for _, sub, _ in self.nested)

    def build(self, values: list) -> Message:
        if self.flat:
            return self.cls(*values)
        args, k = [], 0
        for _, sub, n in self.nested:
            args.append(values[k] if sub is None else sub(*values[k:k + n]))
            k += n
        return self.cls(*args)


SPECS: dict[MsgType, _Spec] = {MsgType(m.WIRE.code): _Spec(m) for m in MESSAGES}
_SPEC_OF_CLASS = {s.cls: s for s in SPECS.values()}


# ---------------------------------------------------------------- value → tensor

def _payload_checksum(payloads: list[np.ndarray]) -> int:
    # Position-weighted CRC-32s: catches swapped, shifted and damaged payloads. zlib, not a
    # torch/numpy reduction: on a reader thread that wakes per message the small C routine
    # skips the tensor ops' cold dispatch paths (docs/measured/publication.md).
    return sum((j + 1) * zlib.crc32(np.ascontiguousarray(p)) for j, p in enumerate(payloads)
               if p.size) % _MOD


def _utf8(spec: _Spec, texts: list[str | None]) -> list[bytes | None]:
    out = []
    for name, s in zip(spec.text_names, texts):
        try:
            out.append(None if s is None else s.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate
            raise ChannelError(f"{spec.name}.{name}: not encodable as utf-8 ({e})") from None
    return out


def encode_arrays(msg: Message,
                  limits: Limits = DEFAULT_LIMITS) -> tuple[list[int], list[np.ndarray]]:
    """One message as (its 16 header values, its payloads as flat numpy arrays)."""
    spec = _SPEC_OF_CLASS.get(type(msg))
    if spec is None:
        raise ChannelError(f"cannot encode {type(msg).__name__}: not a channel message")
    for name, sub, _ in spec.nested:
        if sub is not None and not isinstance(getattr(msg, name), sub):
            raise ChannelError(f"{spec.name}.{name} must be a {sub.__name__}, got "
                               f"{type(getattr(msg, name)).__name__}")
    out = Slots()
    for f in spec.fields:
        f.kind.put(f.where, f.value(msg), out)
    payloads = out.arrays
    if spec.n_ints:
        raw = _utf8(spec, out.texts)
        payloads.append(np.array(out.ints + [-1 if b is None else len(b) for b in raw],
                                 dtype=np.int64))
    if spec.n_floats:
        payloads.append(np.array(out.floats, dtype=np.float64))
    if spec.n_texts:
        payloads.append(np.frombuffer(bytearray(b"".join(b for b in raw if b)), dtype=np.uint8))
    h = [0] * HEADER_LEN
    h[0], h[1], h[2], h[3], h[4] = MAGIC, WIRE_VERSION, int(spec.type), out.version, len(payloads)
    for j, p in enumerate(payloads):
        h[5 + j] = (p.size << 8) | _CODE_OF[_TORCH_OF[p.dtype.type]]
    h[14] = _payload_checksum(payloads)
    h[15] = sum(h[:15]) % _MOD
    check_header_values(h, limits)  # the sender learns of an over-limit message, not the peer
    return h, payloads


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS) -> list[torch.Tensor]:
    """The tensors of one message: [header int64[16], payload_0, ...], all on CPU."""
    h, payloads = encode_arrays(msg, limits)
    return [torch.tensor(h, dtype=torch.int64),
            *(torch.from_numpy(p) if p.size else torch.empty(0, dtype=_TORCH_OF[p.dtype.type])
              for p in payloads)]  # numpy's empty arrays can have stride 0: not viewable


# ---------------------------------------------------------------- tensor → value

def check_header(header: torch.Tensor,
                 limits: Limits = DEFAULT_LIMITS) -> tuple[MsgType, list[PayloadSpec]]:
    """Validate a header; return the type and the (name, dtype, numel) of each payload."""
    if not isinstance(header, torch.Tensor) or header.dtype != torch.int64 \
            or tuple(header.shape) != (HEADER_LEN,):
        got = (f"{header.dtype}{list(header.shape)}" if isinstance(header, torch.Tensor)
               else type(header).__name__)
        raise ChannelError(f"header must be int64[{HEADER_LEN}], got {got}")
    return check_header_values(header.tolist(), limits)


def check_header_values(h: list[int],
                        limits: Limits = DEFAULT_LIMITS) -> tuple[MsgType, list[PayloadSpec]]:
    """`check_header` on the header's 16 values (a reader that holds them as a list)."""
    if h[0] != MAGIC:
        raise ChannelError(f"bad magic 0x{h[0] & ((1 << 64) - 1):x} (expected 0x{MAGIC:x}): "
                           f"not a tsync channel message, or the stream is out of step")
    if h[1] != WIRE_VERSION:
        raise ChannelError(f"wire version {h[1]}, this side speaks {WIRE_VERSION}")
    spec = SPECS.get(h[2])
    if spec is None:
        raise ChannelError(f"unknown message type {h[2]}")
    name, schema = spec.name, spec.payloads
    if h[4] != len(schema):
        raise ChannelError(f"{name}: header announces {h[4]} payload tensors, the type has "
                           f"{len(schema)}")
    specs = []
    for j, (pname, dtype, rule) in enumerate(schema):
        desc = h[5 + j]
        code, numel = desc & 0xFF, desc >> 8
        if DTYPE_CODES.get(code) != dtype:
            raise ChannelError(f"{name} payload {j} ({pname}): dtype code {code} "
                               f"({DTYPE_CODES.get(code, 'unknown')}), expected {dtype}")
        if isinstance(rule, int):
            if numel != rule:
                raise ChannelError(f"{name} payload {j} ({pname}): {numel} elements, expected "
                                   f"{rule}")
        else:
            limit = getattr(limits, _LIMIT_OF[rule])
            if numel < 0:
                raise ChannelError(f"{name} payload {j} ({pname}): negative size {numel}")
            if numel > limit:
                raise ChannelError(f"{name} payload {j} ({pname}): {numel} elements, over the "
                                   f"limit {_LIMIT_OF[rule]}="
                                   f"{limit}")
        specs.append((pname, dtype, numel))
    if any(h[5 + len(schema):14]):
        raise ChannelError(f"{name}: header has descriptors beyond its {len(schema)} payloads")
    if h[15] != sum(h[:15]) % _MOD:
        raise ChannelError(f"{name}: header checksum mismatch (corrupted header)")
    return spec.type, specs


def decode(tensors: list[torch.Tensor], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Rebuild one message from its tensors; ChannelError names any structural problem."""
    if not tensors:
        raise ChannelError("empty message: no header tensor")
    kind, specs = check_header(tensors[0], limits)
    name, payloads = SPECS[kind].name, list(tensors[1:])
    if len(payloads) != len(specs):
        what = "truncated" if len(payloads) < len(specs) else "extra tensors"
        raise ChannelError(f"{name}: {what}: header announces {len(specs)} payload tensors, "
                           f"got {len(payloads)}")
    for j, (p, (pname, dtype, numel)) in enumerate(zip(payloads, specs)):
        where = f"{name} payload {j} ({pname})"
        if not isinstance(p, torch.Tensor) or p.dtype != dtype:
            got = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
            raise ChannelError(f"{where}: dtype {got}, expected {dtype}")
        if p.numel() != numel:
            raise ChannelError(f"{where}: truncated payload: {p.numel()} elements, header says "
                               f"{numel}")
    return decode_arrays(kind, tensors[0].tolist(),
                         [p.reshape(-1).cpu().numpy() for p in payloads])


def _texts(spec: _Spec, raw: bytes, lengths: list[int]) -> list[str | None]:
    out, at = [], 0
    for n, name in zip(lengths, spec.text_names):
        if n == -1:
            out.append(None)
            continue
        if n < 0 or at + n > len(raw):
            raise ChannelError(f"{spec.name} {name}: byte length {n} does not fit the "
                               f"{len(raw)}-byte text payload")
        try:
            out.append(raw[at:at + n].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ChannelError(f"{spec.name} {name}: invalid utf-8 ({e})") from None
        at += n
    if at != len(raw):
        raise ChannelError(f"{spec.name}: text lengths cover {at} of the text payload's "
                           f"{len(raw)} bytes")
    return out


def decode_arrays(kind: MsgType, header: list[int], p: list[np.ndarray]) -> Message:
    """Rebuild one message from its checked header values (`check_header_values`) and its
    payloads as flat numpy arrays of the declared dtypes and announced sizes (a reader that
    views them in its receive buffer: no torch op per message). Verifies the payload
    checksum and the type of every value."""
    spec = SPECS[kind]
    if _payload_checksum(p) != header[14]:
        raise ChannelError(f"{spec.name}: payload checksum mismatch (corrupted or reordered "
                           f"payload)")
    m = Slots(header[3], arrays=p)  # the array payloads come first
    j = spec.n_arrays
    if spec.n_ints:
        m.ints = p[j].tolist()
        j += 1
    if spec.n_floats:
        m.floats = p[j].tolist()
        j += 1
    if spec.n_texts:
        m.texts = _texts(spec, p[j].tobytes(), m.ints[spec.n_scalars:])
    return spec.build([get(where, m, at) for get, where, at in spec.getters])


# ---------------------------------------------------------------- documentation

def _where(spec: _Spec, f: _Field) -> str:
    k, at, out = f.kind, f.at, []
    if k.header:
        out.append("header[3]")
    if k.ints:
        out.append(f"ints[{at.i}]" if k.ints == 1 else f"ints[{at.i}..{at.i + k.ints - 1}]")
    if k.floats:
        out.append(f"floats[{at.f}]")
    if k.array is not None:
        out.append(f"payload {at.a}")
    if k.texts:
        out.append(f"text #{at.t} (bytes: ints[{spec.n_scalars + at.t}])")
    return ", ".join(out)


def _size(rule: int | str) -> str:
    return f"≤ {_LIMIT_OF[rule]}" if rule in _LIMIT_OF else str(rule)


def schema_table() -> str:
    """The wire layout of every message type as Markdown (docs/design/wire.md embeds it)."""
    lines = ["| type | message | direction | payloads, in order |", "|---|---|---|---|"]
    for s in SPECS.values():
        pays = "; ".join(f"{n.split(':')[0]} {str(dt).removeprefix('torch.')}[{_size(r)}]"
                         for n, dt, r in s.payloads)
        lines.append(f"| {int(s.type)} | {s.name} | {s.sender} | {pays} |")
    for s in SPECS.values():
        doc = " ".join((s.cls.__doc__ or "").split())
        lines += ["", f"#### {s.name} ({int(s.type)}, {s.sender})", "", doc, "",
                  "| field | value | on the wire |", "|---|---|---|"]
        lines += [f"| {f.name} | {f.kind.doc} | {_where(s, f)} |" for f in s.fields]
    return "\n".join(lines) + "\n"
