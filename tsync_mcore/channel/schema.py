"""The declaration layer of the wire format: every message field names its wire kind once.

    @message(code=1, sender=LEARNER)
    class Hello:
        version: int = on_wire(VERSION)   # header[3]
        data_pos: int = on_wire(I64)      # one slot of the packed int64 payload

`message` makes the class a frozen dataclass and records its type code and sending side;
`on_wire(kind)` is a dataclass field that carries its kind. `wire.py` derives everything
else from these: encoding, decoding, the structural checks, which side may send what, and
the table in docs/design/wire.md. A kind decides where its value travels:

- `header`: the policy-version slot of the header (VERSION);
- `ints` / `floats`: slots of the message's packed int64 / float64 payload (small scalars
  share one payload: a payload costs a descriptor, a CRC and a view on every message);
- `texts`: strings of the packed utf-8 `text` payload (their byte lengths are the last
  slots of `ints`, −1 for None);
- `array`: a payload of its own of that dtype, ≤ Limits.max_tokens elements.

`put` checks a value and appends it to a `Slots`; `get` reads it back from the decoded
`Slots` at the offsets (`At`) `wire.py` computed for the field. Both raise ChannelError
naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, dataclass_transform

import numpy as np
import torch

from tsync_mcore.channel.errors import ChannelError

# The sending side of a message type; a link refuses a type from the other side.
ROLLOUT, LEARNER, EITHER = "rollout → learner", "learner → rollout", "either direction"
NO_VERSION = -1  # header policy-version slot of a message without a VERSION field
_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass
class Slots:
    """One message's values in wire order: what `put` fills and `get` reads."""

    version: int = NO_VERSION
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)
    arrays: list[np.ndarray] = field(default_factory=list)


class At(NamedTuple):
    """A field's first slot in each packed payload, and its array payload's index."""

    i: int
    f: int
    t: int
    a: int


class Kind:
    """How one field travels. Subclasses set the slots they take and convert the value."""

    header = False
    ints = floats = texts = 0
    array: torch.dtype | None = None
    limit = "tokens"  # the Limits field bounding its array payload: max_tokens or max_routed
    doc = ""  # the value, as the docs table describes it

    def put(self, name: str, v: Any, out: Slots) -> None:
        raise NotImplementedError

    def get(self, name: str, m: Slots, at: At) -> Any:
        raise NotImplementedError


# ---------------------------------------------------------------- value checks

def as_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) \
            or not _INT64[0] <= v <= _INT64[1]:
        raise ChannelError(f"{name} must be an int64 integer, got {v!r}")
    return int(v)


def as_real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ChannelError(f"{name} must be a real number, got {v!r}")
    return float(v)


def as_str(name: str, v) -> str:
    if not isinstance(v, str):
        raise ChannelError(f"{name} must be a str, got {type(v).__name__}")
    return v


def _flag(name: str, v: int, what: str) -> bool:
    if v not in (0, 1):
        raise ChannelError(f"{name}: {what} flag {v} is not 0/1")
    return v == 1


def _int_array(name: str, seq) -> np.ndarray:
    if len(seq) == 0:
        return np.empty(0, dtype=np.int64)
    # numpy infers the type (and is faster than torch.tensor on a list), so floats, bools
    # and huge ints are caught instead of truncated.
    a = np.array(seq)
    if a.ndim != 1 or a.dtype.kind not in "iu" or (a.dtype.kind == "u" and a.max() > _INT64[1]):
        raise ChannelError(f"{name} must be a flat sequence of integers within int64, got "
                           f"numpy dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


# ---------------------------------------------------------------- kinds

class _Version(Kind):
    header, doc = True, "int64, the header's policy-version slot"

    def put(self, name, v, out):
        out.version = as_int(name, v)

    def get(self, name, m, at):
        return m.version


class _I64(Kind):
    ints, doc = 1, "int64"

    def put(self, name, v, out):
        out.ints.append(as_int(name, v))

    def get(self, name, m, at):
        return m.ints[at.i]


class _Bool(Kind):
    ints, doc = 1, "bool (0/1)"

    def put(self, name, v, out):
        if not isinstance(v, bool):
            raise ChannelError(f"{name} must be a bool, got {v!r}")
        out.ints.append(int(v))

    def get(self, name, m, at):
        return _flag(name, m.ints[at.i], name.rsplit(".", 1)[-1])


class _OptI64(Kind):
    ints, doc = 2, "int64 or None: a 0/1 presence flag, then the value"

    def put(self, name, v, out):
        out.ints += (0, 0) if v is None else (1, as_int(name, v))

    def get(self, name, m, at):
        has = _flag(name, m.ints[at.i], f"has_{name.rsplit('.', 1)[-1]}")
        return m.ints[at.i + 1] if has else None


class _F64(Kind):
    floats, doc = 1, "float64"

    def put(self, name, v, out):
        out.floats.append(as_real(name, v))

    def get(self, name, m, at):
        return m.floats[at.f]


class _OptF64(Kind):
    floats, doc = 1, "float64 or None (NaN)"

    def put(self, name, v, out):
        out.floats.append(math.nan if v is None else as_real(name, v))

    def get(self, name, m, at):
        x = m.floats[at.f]
        return None if x != x else x


class Str(Kind):
    """utf-8 text; `choices` (when given) are the only values accepted, None among them when
    `optional`."""

    texts = 1

    def __init__(self, nonempty: bool = False, choices: tuple[str, ...] | None = None,
                 optional: bool = False):
        self.nonempty, self.choices, self.optional = nonempty, choices, optional
        self.doc = ("str" + (", non-empty" if nonempty else "")
                    + (f", one of {', '.join(choices)}" if choices else "")
                    + (" or None" if optional else ""))

    def _check(self, name: str, v):
        if v is None and self.optional:
            return None
        if self.choices is not None and v not in self.choices:
            raise ChannelError(f"{name} must be one of {list(self.choices)}"
                               f"{' or None' if self.optional else ''}, got {v!r}")
        if self.nonempty and (not isinstance(v, str) or not v):
            raise ChannelError(f"{name} must be a non-empty str, got {v!r}")
        return as_str(name, v)

    def put(self, name, v, out):
        out.texts.append(self._check(name, v))

    def get(self, name, m, at):
        return self._check(name, m.texts[at.t])


class Json(Kind):
    """A JSON value (utf-8 text) whose structure `ok` accepts; "... must {what}" otherwise."""

    texts = 1

    def __init__(self, ok: Callable[[Any], bool], what: str):
        self.ok, self.what, self.doc = ok, what, f"JSON that must {what}"

    def _check(self, name, v):
        if not self.ok(v):
            raise ChannelError(f"{name} must {self.what}, got {v!r:.200}")
        return v

    def put(self, name, v, out):
        try:
            text = json.dumps(self._check(name, v), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ChannelError(f"{name}: not JSON-serialisable ({e})") from None
        out.texts.append(text)

    def get(self, name, m, at):
        try:
            v = json.loads(m.texts[at.t])
        except json.JSONDecodeError as e:
            raise ChannelError(f"{name}: invalid JSON ({e})") from None
        return self._check(name, v)


class _Tokens(Kind):
    array, doc = torch.int64, "tuple of int64"

    def put(self, name, v, out):
        out.arrays.append(_int_array(name, v))

    def get(self, name, m, at):
        return tuple(m.arrays[at.a].tolist())


class _Mask(Kind):
    array, doc = torch.uint8, "tuple of ints in 0..255"

    def put(self, name, v, out):
        a = _int_array(name, v)
        if a.size and (a.min() < 0 or a.max() > 255):
            raise ChannelError(f"{name}: values must fit uint8 (0..255)")
        out.arrays.append(a.astype(np.uint8))

    def get(self, name, m, at):
        return tuple(m.arrays[at.a].tolist())


class _OptF64s(Kind):
    array, doc = torch.float64, "tuple of float64 or None (NaN)"

    def put(self, name, v, out):
        out.arrays.append(np.array([math.nan if x is None else as_real(name, x) for x in v],
                                   dtype=np.float64))

    def get(self, name, m, at):
        return tuple([None if x != x else x for x in m.arrays[at.a].tolist()])


class _Routed(Kind):
    """`RoutedExperts` or None: layers and top-k in two int slots (0, 0: None), the ids a
    uint8 array of rows·layers·topk (its own limit: a token carries layers·topk of them)."""

    ints, array, limit = 2, torch.uint8, "routed"
    doc = "RoutedExperts or None: ints layers, topk (0, 0: None); ids uint8 [rows·layers·topk]"

    def put(self, name, v, out):
        from tsync_mcore.channel.sources import RoutedExperts
        if v is None:
            out.ints += (0, 0)
            out.arrays.append(np.empty(0, dtype=np.uint8))
            return
        if not isinstance(v, RoutedExperts) or not isinstance(v.ids, bytes):
            raise ChannelError(f"{name} must be a RoutedExperts or None, got {type(v).__name__}")
        layers, topk = as_int(f"{name}.layers", v.layers), as_int(f"{name}.topk", v.topk)
        if layers < 1 or topk < 1 or len(v.ids) % (layers * topk):
            raise ChannelError(f"{name}: {len(v.ids)} ids do not fill rows of {layers} layers "
                               f"× top-{topk}")
        out.ints += (layers, topk)
        out.arrays.append(np.frombuffer(v.ids, dtype=np.uint8).copy())  # writable for torch

    def get(self, name, m, at):
        from tsync_mcore.channel.sources import RoutedExperts
        layers, topk, ids = m.ints[at.i], m.ints[at.i + 1], m.arrays[at.a]
        if layers == topk == 0 and ids.size == 0:
            return None
        if layers < 1 or topk < 1 or ids.size % (layers * topk):
            raise ChannelError(f"{name}: {ids.size} ids do not fill rows of {layers} layers × "
                               f"top-{topk}")
        return RoutedExperts(layers, topk, ids.tobytes())


class _FloatMap(Kind):
    """dict str → float: the values as a float64 array (bit for bit), the keys as a JSON list."""

    array, texts = torch.float64, 1
    doc = "dict str → float64: values an array, keys a JSON list (distinct, one per value)"

    def put(self, name, v, out):
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise ChannelError(f"{name} must be a dict of str keys to numbers")
        out.arrays.append(np.array([as_real(f"{name}[{k!r}]", x) for k, x in v.items()],
                                   dtype=np.float64))
        out.texts.append(json.dumps(list(v), ensure_ascii=False))

    def get(self, name, m, at):
        values = m.arrays[at.a]
        try:
            keys = json.loads(m.texts[at.t])
        except json.JSONDecodeError as e:
            raise ChannelError(f"{name} keys: invalid JSON ({e})") from None
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)
                and len(keys) == values.size and len(set(keys)) == len(keys)):
            raise ChannelError(f"{name} keys: expected a list of distinct str keys, one per "
                               f"reward ({values.size}), got {keys!r:.200}")
        return dict(zip(keys, values.tolist()))


class Nested(Kind):
    """A dataclass value whose own fields travel (`TrajectoryMsg.source`); `fields` names
    each one's kind, in the dataclass's field order. On the wire they are the message's
    fields `<name>.<field>`."""

    def __init__(self, cls: type, **fields: Kind):
        have = [f.name for f in dataclasses.fields(cls)]
        if list(fields) != have:
            raise TypeError(f"Nested({cls.__name__}): declare exactly its fields in order "
                            f"{have}, got {list(fields)}")
        self.cls, self.fields = cls, fields


VERSION = _Version()
I64 = _I64()
BOOL = _Bool()
OPT_I64 = _OptI64()
F64 = _F64()
OPT_F64 = _OptF64()
STR = Str()
TOKENS = _Tokens()  # int64 array (token ids, any int64)
MASK = _Mask()  # uint8 array
OPT_F64S = _OptF64s()  # float64 array, NaN = None
FLOAT_MAP = _FloatMap()
ROUTED = _Routed()


# ---------------------------------------------------------------- declaring a message

@dataclass(frozen=True)
class WireType:
    code: int  # the header's message-type slot
    sender: str  # ROLLOUT, LEARNER or EITHER


def on_wire(kind: Kind, **field_kwargs):
    """A message's dataclass field (`default=`, `default_factory=` as `dataclasses.field`)
    that travels as `kind`."""
    return field(metadata={"wire": kind}, **field_kwargs)


_DECLARED: list[type] = []


@dataclass_transform(frozen_default=True, field_specifiers=(on_wire,))
def message(code: int, sender: str):
    """Class decorator: a frozen dataclass whose every field is `on_wire`, with its wire
    type code and sending side."""
    assert sender in (ROLLOUT, LEARNER, EITHER), sender

    def make(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        missing = [f.name for f in dataclasses.fields(cls) if "wire" not in f.metadata]
        if missing:
            raise TypeError(f"{cls.__name__}: fields {missing} do not say how they travel "
                            f"(on_wire(KIND))")
        if any(m.WIRE.code == code for m in _DECLARED):
            raise TypeError(f"{cls.__name__}: message type code {code} is taken")
        cls.WIRE = WireType(code, sender)
        _DECLARED.append(cls)
        return cls

    return make


def declared_messages() -> tuple[type, ...]:
    """Every `message` class, in declaration order."""
    return tuple(_DECLARED)
