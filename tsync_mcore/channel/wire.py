"""Message ⇄ tensor codec: an int64[16] header followed by typed payload tensors.

Pure functions, no processes: `encode(msg)` gives the tensors a link sends in order,
`decode(tensors)` checks structure (magic, wire version, type, payload count, dtypes, sizes
within `Limits`, checksums) and rebuilds the dataclass. `check_header` runs the header part
alone, so a receiver can validate sizes *before* it allocates payload buffers.
"""

from __future__ import annotations

import json
import math
import numbers
import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from tsync_mcore.channel.errors import ChannelError
from tsync_mcore.channel.messages import (
    Ack, CloseBatch, GroupRewards, Hello, Message, Publish, RegisterBatch, Shutdown,
    TrajectoryMsg, TurnMsg,
)
from tsync_mcore.routing import ROUTINGS
from tsync_mcore.schedule import SCHEDULES
from tsync_mcore.sources import TrajectorySource, TurnSource

MAGIC = 0x7473796E63  # b"tsync"
WIRE_VERSION = 4  # 2: payload checksum is position-weighted CRC-32; 3: GroupRewards;
# 4: a message travels as one fixed-size frame (header + payloads), see link.py
HEADER_LEN = 16
MAX_PAYLOADS = 9  # header slots 5..13
NO_VERSION = -1  # policy-version slot of messages that have none (Shutdown)
_MOD = 1 << 62  # checksums stay far from int64 overflow
_I64 = (-(1 << 63), (1 << 63) - 1)

DTYPE_CODES: dict[int, torch.dtype] = {1: torch.int64, 2: torch.uint8, 3: torch.float64}
_CODE_OF = {dt: c for c, dt in DTYPE_CODES.items()}


class MsgType(IntEnum):
    HELLO = 1
    REGISTER_BATCH = 2
    TRAJECTORY = 3
    TURN = 4
    CLOSE_BATCH = 5
    PUBLISH = 6
    ACK = 7
    SHUTDOWN = 8
    GROUP_REWARDS = 9


@dataclass(frozen=True)
class Limits:
    """Largest payloads a receiver accepts; checked before any buffer is allocated."""

    max_tokens: int = 1 << 20  # per trajectory / turn
    max_bytes: int = 64 << 20  # per string / JSON payload


DEFAULT_LIMITS = Limits()

# Payload size rules: an exact element count, or bounded by a Limits field.
TOKENS, BYTES = "tokens", "bytes"
_I, _U8, _F = torch.int64, torch.uint8, torch.float64
SCHEMA: dict[MsgType, tuple[tuple[str, torch.dtype, int | str], ...]] = {
    MsgType.HELLO: (("data_pos", _I, 1),),
    MsgType.REGISTER_BATCH: (("data_pos", _I, 1), ("batch_json", _U8, BYTES)),
    MsgType.TRAJECTORY: (
        ("tokens", _I, TOKENS), ("scored_mask", _U8, TOKENS), ("reward", _F, 1),
        ("ints", _I, 3),  # ready_order, has_prompt_len, prompt_len
        ("ids_json", _U8, BYTES)),  # [traj_id, group_id]
    MsgType.TURN: (
        ("tokens", _I, TOKENS), ("scored_mask", _U8, TOKENS),
        ("teacher_logprobs", _F, TOKENS),  # NaN = None
        ("ints", _I, 6),  # turn, n_turns, start, ready_order, has_prompt_len, prompt_len
        ("ids_json", _U8, BYTES)),
    MsgType.CLOSE_BATCH: (("n_sources", _I, 1), ("times", _F, 2)),  # rollout_time_s, reward_mean
    MsgType.PUBLISH: (("path", _U8, BYTES),),
    MsgType.ACK: (("ok", _I, 1), ("reload_time_s", _F, 1), ("error", _U8, BYTES)),
    MsgType.SHUTDOWN: (("reason", _U8, BYTES),),
    MsgType.GROUP_REWARDS: (("rewards", _F, TOKENS), ("ids_json", _U8, BYTES)),  # [group, [trajs]]
}
_TYPE_OF: dict[type, MsgType] = {
    Hello: MsgType.HELLO, RegisterBatch: MsgType.REGISTER_BATCH, TrajectoryMsg: MsgType.TRAJECTORY,
    TurnMsg: MsgType.TURN, CloseBatch: MsgType.CLOSE_BATCH, Publish: MsgType.PUBLISH,
    Ack: MsgType.ACK, Shutdown: MsgType.SHUTDOWN, GroupRewards: MsgType.GROUP_REWARDS,
}
_NAME_OF = {MsgType.HELLO: "Hello", MsgType.REGISTER_BATCH: "RegisterBatch",
            MsgType.TRAJECTORY: "TrajectoryMsg", MsgType.TURN: "TurnMsg",
            MsgType.CLOSE_BATCH: "CloseBatch", MsgType.PUBLISH: "Publish", MsgType.ACK: "Ack",
            MsgType.SHUTDOWN: "Shutdown", MsgType.GROUP_REWARDS: "GroupRewards"}


# ---------------------------------------------------------------- value → tensor

def _int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not _I64[0] <= v <= _I64[1]:
        raise ChannelError(f"{name} must be an int64 integer, got {v!r}")
    return int(v)


def _real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ChannelError(f"{name} must be a real number, got {v!r}")
    return float(v)


def _int_seq(name: str, seq) -> torch.Tensor:
    if len(seq) == 0:
        return torch.empty(0, dtype=_I)
    # numpy infers the type (4x faster than torch.tensor on a list), so floats, bools and
    # huge ints are caught instead of truncated.
    a = np.array(seq)
    if a.ndim != 1 or a.dtype.kind not in "iu" or (a.dtype.kind == "u" and a.max() > _I64[1]):
        raise ChannelError(f"{name} must be a flat sequence of integers within int64, got "
                           f"numpy dtype {a.dtype}")
    return torch.from_numpy(a.astype(np.int64, copy=False))


def _mask(name: str, seq) -> torch.Tensor:
    t = _int_seq(name, seq)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > 255):
        raise ChannelError(f"{name}: values must fit uint8 (0..255)")
    return t.to(_U8)


def _nullable_floats(name: str, seq) -> torch.Tensor:
    return torch.tensor([math.nan if x is None else _real(name, x) for x in seq], dtype=_F)


def _text(name: str, s) -> torch.Tensor:
    if not isinstance(s, str):
        raise ChannelError(f"{name} must be a str, got {type(s).__name__}")
    try:
        raw = s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChannelError(f"{name}: not encodable as utf-8 ({e})") from None
    return torch.frombuffer(bytearray(raw), dtype=_U8) if raw else torch.empty(0, dtype=_U8)


def _json(name: str, obj) -> torch.Tensor:
    return _text(name, json.dumps(obj, ensure_ascii=False, allow_nan=False))


def _scalar(dtype: torch.dtype, *vals) -> torch.Tensor:
    return torch.tensor(list(vals), dtype=dtype)


def _source_ids(name: str, traj_id, group_id) -> torch.Tensor:
    for field_name, v in (("traj_id", traj_id), ("group_id", group_id)):
        if not isinstance(v, str):
            raise ChannelError(f"{name}.{field_name} must be a str, got {v!r}")
    return _json(f"{name} ids", [traj_id, group_id])


def _prompt_len(name: str, v) -> tuple[int, int]:
    return (0, 0) if v is None else (1, _int(f"{name}.prompt_len", v))


def _payloads(msg) -> tuple[MsgType, int, list[torch.Tensor]]:
    """(type, policy version, payload tensors) of one message."""
    kind = _TYPE_OF.get(type(msg))
    if kind is None:
        raise ChannelError(f"cannot encode {type(msg).__name__}: not a channel message")
    if isinstance(msg, Hello):
        return kind, _int("Hello.version", msg.version), [
            _scalar(_I, _int("Hello.data_pos", msg.data_pos))]
    if isinstance(msg, RegisterBatch):
        return kind, _int("RegisterBatch.version", msg.version), [
            _scalar(_I, _int("RegisterBatch.data_pos", msg.data_pos)),
            _json("RegisterBatch", _check_batch_obj(
                {"objective": msg.objective, "groups": msg.groups, "n_turns": msg.n_turns,
                 "routing": msg.routing,
                 **({"schedule": msg.schedule} if msg.schedule is not None else {})},
                "RegisterBatch"))]
    if isinstance(msg, TrajectoryMsg):
        s, n = msg.source, "TrajectoryMsg"
        if not isinstance(s, TrajectorySource):
            raise ChannelError(f"{n}.source must be a TrajectorySource, got {type(s).__name__}")
        return kind, _int(f"{n}.policy_version", s.policy_version), [
            _int_seq(f"{n}.tokens", s.tokens), _mask(f"{n}.scored_mask", s.scored_mask),
            _scalar(_F, _real(f"{n}.reward", s.reward)),
            _scalar(_I, _int(f"{n}.ready_order", s.ready_order), *_prompt_len(n, s.prompt_len)),
            _source_ids(n, s.traj_id, s.group_id)]
    if isinstance(msg, TurnMsg):
        s, n = msg.source, "TurnMsg"
        if not isinstance(s, TurnSource):
            raise ChannelError(f"{n}.source must be a TurnSource, got {type(s).__name__}")
        ints = [_int(f"{n}.{k}", getattr(s, k))
                for k in ("turn", "n_turns", "start", "ready_order")]
        return kind, _int(f"{n}.policy_version", s.policy_version), [
            _int_seq(f"{n}.tokens", s.tokens), _mask(f"{n}.scored_mask", s.scored_mask),
            _nullable_floats(f"{n}.teacher_logprobs", s.teacher_logprobs),
            _scalar(_I, *ints, *_prompt_len(n, s.prompt_len)),
            _source_ids(n, s.traj_id, s.group_id)]
    if isinstance(msg, GroupRewards):
        n = "GroupRewards"
        if not isinstance(msg.group_id, str) or not isinstance(msg.rewards, dict) or not all(
                isinstance(t, str) for t in msg.rewards):
            raise ChannelError(f"{n}: group_id must be a str and rewards a dict of str "
                               f"trajectory ids to numbers")
        ids = list(msg.rewards)
        return kind, _int(f"{n}.version", msg.version), [
            torch.tensor([_real(f"{n}.rewards[{t!r}]", msg.rewards[t]) for t in ids], dtype=_F),
            _json(n, [msg.group_id, ids])]
    if isinstance(msg, CloseBatch):
        return kind, _int("CloseBatch.version", msg.version), [
            _scalar(_I, _int("CloseBatch.n_sources", msg.n_sources)),
            _scalar(_F, _real("CloseBatch.rollout_time_s", msg.rollout_time_s),
                    math.nan if msg.reward_mean is None
                    else _real("CloseBatch.reward_mean", msg.reward_mean))]
    if isinstance(msg, Publish):
        return kind, _int("Publish.version", msg.version), [_text("Publish.path", msg.path)]
    if isinstance(msg, Ack):
        if not isinstance(msg.ok, bool):
            raise ChannelError(f"Ack.ok must be a bool, got {msg.ok!r}")
        return kind, _int("Ack.version", msg.version), [
            _scalar(_I, int(msg.ok)), _scalar(_F, _real("Ack.reload_time_s", msg.reload_time_s)),
            _text("Ack.error", msg.error)]
    return kind, NO_VERSION, [_text("Shutdown.reason", msg.reason)]


def _payload_checksum(payloads: list[np.ndarray]) -> int:
    # Position-weighted CRC-32s: catches swapped, shifted and damaged payloads. zlib, not a
    # torch/numpy reduction: on a reader thread that wakes per message the small C routine
    # costs a few µs where a tensor reduction cost ~50 µs (cold dispatch paths).
    return sum((j + 1) * zlib.crc32(np.ascontiguousarray(p)) for j, p in enumerate(payloads)
               if p.size) % _MOD


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS) -> list[torch.Tensor]:
    """The tensors of one message: [header int64[16], payload_0, ...], all on CPU."""
    kind, version, payloads = _payloads(msg)
    h = [0] * HEADER_LEN
    h[0], h[1], h[2], h[3], h[4] = MAGIC, WIRE_VERSION, int(kind), version, len(payloads)
    for j, p in enumerate(payloads):
        h[5 + j] = (p.numel() << 8) | _CODE_OF[p.dtype]
    h[14] = _payload_checksum([p.numpy() for p in payloads])
    h[15] = sum(h[:15]) % _MOD
    header = torch.tensor(h, dtype=_I)
    check_header(header, limits)  # the sender learns of an over-limit message, not the peer
    return [header, *payloads]


# ---------------------------------------------------------------- tensor → value

PayloadSpec = tuple[str, torch.dtype, int]  # name, dtype, element count


def check_header(header: torch.Tensor,
                 limits: Limits = DEFAULT_LIMITS) -> tuple[MsgType, list[PayloadSpec]]:
    """Validate a header; return the type and the (name, dtype, numel) of each payload."""
    if not isinstance(header, torch.Tensor) or header.dtype != _I \
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
    try:
        kind = MsgType(h[2])
    except ValueError:
        raise ChannelError(f"unknown message type {h[2]}") from None
    name, schema = _NAME_OF[kind], SCHEMA[kind]
    if h[4] != len(schema):
        raise ChannelError(f"{name}: header announces {h[4]} payload tensors, the type has "
                           f"{len(schema)}")
    specs = []
    for j, (pname, dtype, rule) in enumerate(schema):
        desc = h[5 + j]
        code, numel = desc & 0xFF, desc >> 8
        where = f"{name} payload {j} ({pname})"
        if DTYPE_CODES.get(code) != dtype:
            raise ChannelError(f"{where}: dtype code {code} "
                               f"({DTYPE_CODES.get(code, 'unknown')}), expected {dtype}")
        if isinstance(rule, int) and numel != rule:
            raise ChannelError(f"{where}: {numel} elements, expected {rule}")
        limit = limits.max_tokens if rule == TOKENS else limits.max_bytes
        if not isinstance(rule, int) and not 0 <= numel <= limit:
            raise ChannelError(f"{where}: {numel} elements, over the limit "
                               f"{'max_tokens' if rule == TOKENS else 'max_bytes'}={limit}")
        specs.append((pname, dtype, numel))
    if any(h[5 + len(schema):14]):
        raise ChannelError(f"{name}: header has descriptors beyond its {len(schema)} payloads")
    if h[15] != sum(h[:15]) % _MOD:
        raise ChannelError(f"{name}: header checksum mismatch (corrupted header)")
    return kind, specs


def _str(name: str, t: np.ndarray) -> str:
    try:
        return t.tobytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ChannelError(f"{name}: invalid utf-8 ({e})") from None


def _load_json(name: str, t: np.ndarray):
    try:
        return json.loads(_str(name, t))
    except json.JSONDecodeError as e:
        raise ChannelError(f"{name}: invalid JSON ({e})") from None


def _check_batch_obj(obj, name: str) -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("objective"), str):
        raise ChannelError(f"{name}: objective must be a str")
    groups, n_turns = obj.get("groups"), obj.get("n_turns")
    if not isinstance(groups, dict) or not all(
            isinstance(g, str) and isinstance(ts, (list, tuple))
            and all(isinstance(t, str) for t in ts) for g, ts in groups.items()):
        raise ChannelError(f"{name}: groups must map str group ids to lists of str trajectory ids")
    if not isinstance(n_turns, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in n_turns.items()):
        raise ChannelError(f"{name}: n_turns must map str trajectory ids to ints")
    if obj.get("routing", "static") not in ROUTINGS:
        raise ChannelError(f"{name}: routing must be one of {list(ROUTINGS)}, "
                           f"got {obj.get('routing')!r}")
    if obj.get("schedule") not in (None, *SCHEDULES):
        raise ChannelError(f"{name}: schedule must be one of {list(SCHEDULES)}, "
                           f"got {obj.get('schedule')!r}")
    return obj


def _ids(name: str, t: np.ndarray) -> tuple[str, str]:
    ids = _load_json(f"{name} ids", t)
    if not (isinstance(ids, list) and len(ids) == 2 and all(isinstance(i, str) for i in ids)):
        raise ChannelError(f"{name} ids: expected [traj_id, group_id] strings, got {ids!r}")
    return ids[0], ids[1]


def _opt_prompt_len(name: str, has: int, value: int) -> int | None:
    if has not in (0, 1):
        raise ChannelError(f"{name}: has_prompt_len flag {has} is not 0/1")
    return value if has else None


def decode(tensors: list[torch.Tensor], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Rebuild one message from its tensors; ChannelError names any structural problem."""
    if not tensors:
        raise ChannelError("empty message: no header tensor")
    kind, specs = check_header(tensors[0], limits)
    name, payloads = _NAME_OF[kind], list(tensors[1:])
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


def decode_arrays(kind: MsgType, header: list[int], p: list[np.ndarray]) -> Message:
    """Rebuild one message from its checked header values (`check_header_values`) and its
    payloads as flat numpy arrays of the schema's dtypes and announced sizes (a reader
    that views them in its receive buffer: no torch op per message). Verifies the payload
    checksum."""
    name = _NAME_OF[kind]
    if _payload_checksum(p) != header[14]:
        raise ChannelError(f"{name}: payload checksum mismatch (corrupted or reordered payload)")
    version = header[3]
    if kind == MsgType.HELLO:
        return Hello(version=version, data_pos=int(p[0][0]))
    if kind == MsgType.REGISTER_BATCH:
        obj = _check_batch_obj(_load_json(f"{name} batch_json", p[1]), name)
        return RegisterBatch(version=version, objective=obj["objective"], groups=obj["groups"],
                             n_turns=obj["n_turns"], data_pos=int(p[0][0]),
                             schedule=obj.get("schedule"), routing=obj.get("routing", "static"))
    if kind == MsgType.TRAJECTORY:
        traj_id, group_id = _ids(name, p[4])
        ready_order, has_pl, pl = p[3].tolist()
        return TrajectoryMsg(TrajectorySource(
            traj_id=traj_id, group_id=group_id, tokens=tuple(p[0].tolist()),
            scored_mask=tuple(p[1].tolist()), reward=float(p[2][0]), policy_version=version,
            ready_order=ready_order, prompt_len=_opt_prompt_len(name, has_pl, pl)))
    if kind == MsgType.TURN:
        traj_id, group_id = _ids(name, p[4])
        turn, n_turns, start, ready_order, has_pl, pl = p[3].tolist()
        teacher = tuple([None if x != x else x for x in p[2].tolist()])  # NaN → null
        return TurnMsg(TurnSource(
            traj_id=traj_id, group_id=group_id, turn=turn, n_turns=n_turns, start=start,
            tokens=tuple(p[0].tolist()), scored_mask=tuple(p[1].tolist()),
            teacher_logprobs=teacher, policy_version=version, ready_order=ready_order,
            prompt_len=_opt_prompt_len(name, has_pl, pl)))
    if kind == MsgType.GROUP_REWARDS:
        ids = _load_json(f"{name} ids", p[1])
        if not (isinstance(ids, list) and len(ids) == 2 and isinstance(ids[0], str)
                and isinstance(ids[1], list) and all(isinstance(t, str) for t in ids[1])
                and len(ids[1]) == p[0].size and len(set(ids[1])) == len(ids[1])):
            raise ChannelError(f"{name} ids: expected [group_id, [distinct trajectory ids, one "
                               f"per reward]], got {ids!r}")
        return GroupRewards(version=version, group_id=ids[0],
                            rewards=dict(zip(ids[1], p[0].tolist())))
    if kind == MsgType.CLOSE_BATCH:
        return CloseBatch(version=version, rollout_time_s=float(p[1][0]), n_sources=int(p[0][0]),
                          reward_mean=None if math.isnan(p[1][1]) else float(p[1][1]))
    if kind == MsgType.PUBLISH:
        return Publish(version=version, path=_str(f"{name} path", p[0]))
    if kind == MsgType.ACK:
        ok = int(p[0][0])
        if ok not in (0, 1):
            raise ChannelError(f"{name}: ok flag {ok} is not 0/1")
        return Ack(version=version, ok=bool(ok), error=_str(f"{name} error", p[2]),
                   reload_time_s=float(p[1][0]))
    return Shutdown(reason=_str(f"{name} reason", p[0]))
