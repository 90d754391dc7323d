"""Readiness channel: wire codec, malformed input, real links between processes, failures."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
import zlib
from dataclasses import replace

import pytest
import torch

from tests.helpers.channel_shared import ALL_MESSAGES
from tests.helpers.dist_util import free_port
from tests.helpers.links import link_pair
from tests.helpers.workers import channel_worker as cw  # noqa: E402
from tsync_mcore.channel import (
    LEARNER_SENDS,
    MAGIC,
    MESSAGES,
    ROLLOUT_SENDS,
    WIRE_VERSION,
    Ack,
    ChannelError,
    ChannelTimeout,
    CloseBatch,
    DropGroup,
    GroupRewards,
    Hello,
    Limits,
    MsgType,
    PeerGone,
    Publish,
    PublishGroup,
    RegisterBatch,
    Rejected,
    Shutdown,
    TrajectoryMsg,
    TurnMsg,
    decode,
    encode,
    open_learner_side,
    open_rollout_side,
    schema,
)
from tsync_mcore.channel.link import realtime_io_permitted
from tsync_mcore.channel.messages import GROUPS, METRICS, TURN_COUNTS
from tsync_mcore.channel.sources import RoutedExperts, TrajectorySource, TurnSource
from tsync_mcore.channel.wire import SPECS


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_every_type(msg):
    tensors = encode(msg)
    header = tensors[0].tolist()
    assert header[:2] == [MAGIC, WIRE_VERSION] and header[4] == len(tensors) - 1
    assert MsgType(header[2]).name.replace("_", "").lower().startswith(
        type(msg).__name__.lower().replace("msg", "")[:4])
    back = decode(tensors)
    assert back == msg and type(back) is type(msg)
    if isinstance(msg, (TrajectoryMsg, TurnMsg)):
        assert header[3] == msg.source.policy_version
        assert all(type(t) is int for t in back.source.tokens)


def _tweak_header(tensors, slot: int, value: int) -> list[torch.Tensor]:
    """Change one header slot and re-seal the header checksum (so the slot check fires)."""
    h = tensors[0].clone()
    h[slot] = value
    h[15] = int(h[:15].sum()) % (1 << 62)
    return [h, *tensors[1:]]


def _seal(header: torch.Tensor, payloads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rewrite descriptors and checksums for these payloads: only the content can object."""
    h = header.clone()
    codes = {torch.int64: 1, torch.uint8: 2, torch.float64: 3}
    for j, p in enumerate(payloads):
        h[5 + j] = (p.numel() << 8) | codes[p.dtype]
    h[14] = sum((j + 1) * zlib.crc32(bytes(p.contiguous().view(torch.uint8).tolist()))
                for j, p in enumerate(payloads)) % (1 << 62)
    h[15] = int(h[:15].sum()) % (1 << 62)
    return [h, *payloads]


def _with_text(tensors, field: str, raw: bytes) -> list[torch.Tensor]:
    """Replace one text field's bytes (and its byte length in the ints payload), sealed."""
    spec = SPECS[MsgType(int(tensors[0][2]))]
    k, j = spec.text_names.index(field), 1 + spec.n_arrays  # tensors[j]: the ints payload
    ints = tensors[j].clone()
    lengths = [max(n, 0) for n in ints[spec.n_scalars:].tolist()]  # -1: None
    at = sum(lengths[:k])
    old = bytes(tensors[-1].tolist())
    text = old[:at] + raw + old[at + lengths[k]:]
    ints[spec.n_scalars + k] = len(raw)
    return _seal(tensors[0], [*tensors[1:j], ints, *tensors[j + 1:-1],
                              torch.tensor(list(text), dtype=torch.uint8)])


def _traj_tensors():
    return encode(cw.bench_message(1))


MALFORMED = {
    "bad magic": (lambda t: _tweak_header(t, 0, 1234), "bad magic"),
    "wire version": (lambda t: _tweak_header(t, 1, 99), "wire version 99"),
    "unknown type": (lambda t: _tweak_header(t, 2, 42), "unknown message type 42"),
    "payload count": (lambda t: _tweak_header(t, 4, 3), "announces 3 payload tensors"),
    "truncated message": (lambda t: t[:3], "truncated: header announces 8 payload tensors, got 2"),
    "truncated payload": (lambda t: [t[0], t[1][:-10], *t[2:]], r"tokens\): truncated payload"),
    "wrong dtype": (lambda t: [t[0], t[1].to(torch.int32), *t[2:]], r"tokens\): dtype torch.int32"),
    "header dtype": (lambda t: [t[0].double(), *t[1:]], r"header must be int64\[16\]"),
    "header checksum": (lambda t: [t[0].clone().index_fill_(0, torch.tensor([3]), 7), *t[1:]],
                        "header checksum mismatch"),
    "payload damaged": (lambda t: [t[0], t[1].clone().index_fill_(0, torch.tensor([5]), 77),
                                   *t[2:]],
                        "payload checksum mismatch"),
    "descriptor dtype": (lambda t: _tweak_header(t, 6, (1000 << 8) | 3),
                         r"scored_mask\): dtype code 3"),
    "empty": (lambda t: [], "empty message"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_rejected_naming_the_problem(case):
    mangle, pattern = MALFORMED[case]
    with pytest.raises(ChannelError, match=pattern):
        decode(mangle(_traj_tensors()))


def test_limits_and_bad_payload_content():
    tensors = _traj_tensors()
    with pytest.raises(ChannelError, match=r"tokens\): 1000 elements, over the limit "
                                           r"max_tokens=999"):
        decode(tensors, Limits(max_tokens=999))
    with pytest.raises(ChannelError, match="max_tokens=10"):  # the sender finds out first
        encode(cw.bench_message(0), Limits(max_tokens=10))
    with pytest.raises(ChannelError, match="path.*max_bytes=4"):
        encode(Publish(1, "/a/long/path"), Limits(max_bytes=4))
    # Payload bytes that pass the checksum but are not what the type promises.
    with pytest.raises(ChannelError, match="Publish path: invalid utf-8"):
        decode(_with_text(encode(Publish(1, "ab")), "path", b"\xff\xfe"))
    # TrajectoryMsg payloads: tokens, scored_mask, behaviour_logprobs, token_versions,
    # routed_experts, then the ints: ready_order, has_prompt_len, prompt_len, layers, topk...
    ints = tensors[6].clone()
    ints[1] = 2  # has_prompt_len flag
    with pytest.raises(ChannelError, match="has_prompt_len flag 2"):
        decode(_seal(tensors[0], [*tensors[1:6], ints, *tensors[7:]]))
    ints = tensors[6].clone()
    ints[3:5] = torch.tensor([0, 2])  # routed_experts: ids present, 0 layers
    with pytest.raises(ChannelError, match="routed_experts: 8 ids do not fill rows of 0 "
                                           "layers × top-2"):
        decode(_seal(tensors[0], [*tensors[1:5], torch.arange(8, dtype=torch.uint8), ints,
                                  *tensors[7:]]))
    reg = encode(RegisterBatch(0, "grpo", {}, {}, 0))
    with pytest.raises(ChannelError, match="RegisterBatch.groups: invalid JSON"):
        decode(_with_text(reg, "groups", b'{"g": '))


def test_register_batch_carries_an_optional_schedule():
    plain = RegisterBatch(3, "opd", {"g": ["a", "b"]}, {"a": 2, "b": 1}, 7)
    assert decode(encode(plain)) == plain and plain.schedule is None
    override = replace(plain, schedule="group_ready")
    assert decode(encode(override)) == override


def test_routing_and_group_rewards_on_the_wire():
    reg = RegisterBatch(3, "grpo", {"g": ["a", "b"]}, {}, 7, routing="balanced")
    assert decode(encode(reg)) == reg
    assert decode(encode(replace(reg, routing="static"))).routing == "static"
    with pytest.raises(ChannelError, match="routing must be one of"):
        encode(replace(reg, routing="random"))
    back = decode(encode(GroupRewards(1, "g", {"a": 0.1 + 0.2, "b": 1 / 3})))
    assert back.rewards == {"a": 0.1 + 0.2, "b": 1 / 3}  # float64, bit for bit
    with pytest.raises(ChannelError, match=r"GroupRewards.rewards\['a'\] must be a real"):
        encode(GroupRewards(1, "g", {"a": "high"}))
    with pytest.raises(ChannelError, match="group_id must be a str"):
        encode(GroupRewards(1, 7, {"a": 1.0}))
    good = encode(GroupRewards(1, "g", {"a": 1.0, "b": 2.0}))
    for keys, why in [(["a"], "one per reward"), (["a", "a"], "distinct"),
                      ({"a": 0}, "expected")]:
        with pytest.raises(ChannelError, match=why):
            decode(_with_text(good, "rewards", json.dumps(keys).encode()))


def test_encode_rejects_what_it_cannot_carry_exactly():
    src = cw.bench_message(0).source
    cases = {
        "tokens must be a flat sequence of integers": replace(src, tokens=(1, 2.5)),
        "scored_mask: values must fit uint8": replace(src, scored_mask=(0, 256)),
        "policy_version must be an int64 integer": replace(src, policy_version=True),
        "traj_id must be a str": replace(src, traj_id=7),
        "tokens must be a flat sequence of integers within int64": replace(src, tokens=(1, 2**70)),
    }
    for pattern, bad in cases.items():
        with pytest.raises(ChannelError, match=pattern):
            encode(TrajectoryMsg(bad))
    with pytest.raises(ChannelError, match="not a channel message"):
        encode("hello")
    with pytest.raises(ChannelError, match="groups must map"):
        encode(RegisterBatch(0, "grpo", {"g": [1, 2]}, {}, 0))
    with pytest.raises(ChannelError, match="schedule must be one of"):
        encode(RegisterBatch(0, "grpo", {}, {}, 0, schedule="eager"))
    with pytest.raises(ChannelError, match="teacher_logprobs must be a real"):
        encode(TurnMsg(TurnSource("t", "g", 0, 1, 0, (1,), (0,), ("x",), 0)))
    nan_reward = decode(encode(TrajectoryMsg(replace(src, reward=math.nan))))
    assert math.isnan(nan_reward.source.reward)  # content checks are the learner's


_BIG, _SMALL = (1 << 63) - 1, -(1 << 63)


# Two edge values per wire kind: a message built from column 0 and one from column 1.
_EDGES = {
    schema.VERSION: (_SMALL, _BIG), schema.I64: (_BIG, _SMALL), schema.BOOL: (False, True),
    schema.OPT_I64: (None, _SMALL), schema.F64: (-0.0, math.inf), schema.OPT_F64: (None, 5e-324),
    schema.STR: ("", "τ\x00 ✓ " * 50), schema.TOKENS: ((), (_BIG, _SMALL, 0)),
    schema.MASK: ((), (0, 255, 1)), schema.OPT_F64S: ((), (None, -0.0, -math.inf, 1e308)),
    schema.FLOAT_MAP: ({}, {"a ✓": -math.inf, "": 2.5e-300}),
    GROUPS: ({}, {"g ✓": ["a", ""], "": []}), TURN_COUNTS: ({}, {"t": _BIG, "": -1}),
    METRICS: ({}, {"eval/pass@1 ✓": 0.5, "reward/errors": 3, "": None}),
    schema.ROUTED: (None, RoutedExperts(3, 2, bytes([0, 255, 7, 1, 2, 3]) * 2)),
}


def _edge(kind, col: int):
    if isinstance(kind, schema.Nested):
        return kind.cls(*(_edge(k, col) for k in kind.fields.values()))
    if isinstance(kind, schema.Str) and kind is not schema.STR:
        options = (*(kind.choices or ("x", "✓" * 9)), *((None,) if kind.optional else ()))
        return options[col % len(options)] if col == 0 else options[-1]
    assert kind in _EDGES, f"no edge values for wire kind {kind.doc!r}: add them to _EDGES"
    return _EDGES[kind][col]


def edge_messages() -> list:
    """Every declared message type, twice: from each column of edge values."""
    return [cls(*(_edge(f.metadata["wire"], col) for f in dataclasses.fields(cls)))
            for cls in MESSAGES for col in (0, 1)]


@pytest.mark.parametrize("msg", edge_messages(), ids=lambda m: type(m).__name__)
def test_every_declared_type_round_trips_its_edge_values(msg):
    tensors = encode(msg)
    back = decode(tensors)
    assert back == msg and type(back) is type(msg)
    assert repr(back) == repr(msg)  # -0.0 stays -0.0, ints stay ints
    spec = SPECS[MsgType(int(tensors[0][2]))]
    assert spec.cls is type(msg) and len(tensors) - 1 == len(spec.payloads)


def test_routed_experts_travel_with_their_own_limit():
    """One byte per id; an empty record and None differ; the ids' count has its own limit
    (a token carries layers·topk of them) and must fill whole rows."""
    empty = RoutedExperts(48, 8, b"")
    src = TrajectorySource("t", "g", (1, 2), (0, 1), 1.0, 0, routed_experts=empty)
    assert decode(encode(TrajectoryMsg(src))).source.routed_experts == empty
    big = RoutedExperts(48, 8, bytes(48 * 8 * 5000))  # 5000 rows: over max_tokens=1e5 ids
    tensors = encode(TrajectoryMsg(TrajectorySource("t", "g", (1, 2), (0, 1), 1.0, 0,
                                                    routed_experts=big)))
    assert decode(tensors, Limits(max_tokens=100_000)).source.routed_experts == big
    with pytest.raises(ChannelError, match=r"routed_experts\): 1920000 elements, over the "
                                           r"limit max_routed=1000000"):
        decode(tensors, Limits(max_routed=1_000_000))
    with pytest.raises(ChannelError, match=r"routed_experts: 5 ids do not fill rows of 3 "
                                           r"layers × top-2"):
        encode(TrajectoryMsg(TrajectorySource("t", "g", (1,), (0,), 1.0, 0,
                                              routed_experts=RoutedExperts(3, 2, bytes(5)))))


def test_directions_and_codes_come_from_the_declarations():
    assert set(ROLLOUT_SENDS) == {RegisterBatch, TrajectoryMsg, TurnMsg, GroupRewards,
                                  CloseBatch, Ack, Shutdown, DropGroup, PublishGroup}
    assert set(LEARNER_SENDS) == {Hello, Publish, Shutdown, Rejected}
    assert {m.name: int(m) for m in MsgType} == {
        "HELLO": 1, "REGISTER_BATCH": 2, "TRAJECTORY": 3, "TURN": 4, "CLOSE_BATCH": 5,
        "PUBLISH": 6, "ACK": 7, "SHUTDOWN": 8, "GROUP_REWARDS": 9, "REJECTED": 10,
        "DROP_GROUP": 11, "PUBLISH_GROUP": 12}
    with pytest.raises(TypeError, match="do not say how they travel"):
        @schema.message(code=99, sender=schema.ROLLOUT)
        class Undeclared:
            version: int = schema.on_wire(schema.VERSION)
            extra: int = 0
    with pytest.raises(TypeError, match="declare exactly its fields"):
        schema.Nested(TurnSource, traj_id=schema.STR)


def test_rejected_and_drop_group_round_trip_and_refuse_bad_values():
    rej = Rejected(version=7, group_id="g/1 ✓", source="t3#2", reason="token 999999 out of vocab")
    drop = DropGroup(version=7, group_id="g/1 ✓", reason="rank 1 rejected t3#2")
    for msg in (rej, drop, Rejected(0, "", "", ""), DropGroup(-1, "", "")):
        assert decode(encode(msg)) == msg
    assert encode(rej)[0][3] == 7  # the update's version rides in the header
    bad = {
        "Rejected.version must be an int64 integer": replace(rej, version="7"),
        "Rejected.group_id must be a str": replace(rej, group_id=1),
        "Rejected.source must be a str": replace(rej, source=None),
        "Rejected.reason must be a str": replace(rej, reason=b"x"),
        "DropGroup.version must be an int64 integer": replace(drop, version=7.0),
        "DropGroup.group_id must be a str": replace(drop, group_id=["g"]),
        "DropGroup.reason must be a str": replace(drop, reason=None),
        "DropGroup.reason: not encodable as utf-8": replace(drop, reason="\ud800"),
    }
    for pattern, msg in bad.items():
        with pytest.raises(ChannelError, match=pattern):
            encode(msg)
    with pytest.raises(ChannelError, match=r"Rejected payload 1 \(text: group_id, source, "
                                           r"reason\): 36 elements, over the limit max_bytes=8"):
        encode(rej, Limits(max_bytes=8))
    # On the wire: each text field's bytes and length are checked by name.
    with pytest.raises(ChannelError, match="Rejected source: invalid utf-8"):
        decode(_with_text(encode(rej), "source", b"t\xff"))
    with pytest.raises(ChannelError, match="DropGroup reason: invalid utf-8"):
        decode(_with_text(encode(drop), "reason", b"\xc3"))
    t = encode(drop)
    lengths = t[1].clone()
    lengths[1] += 1  # the reason's byte length runs past the text payload
    with pytest.raises(ChannelError, match="DropGroup reason: byte length .* does not fit"):
        decode(_seal(t[0], [lengths, t[2]]))
    lengths[0], lengths[1] = 1, 2  # lengths that leave bytes over
    with pytest.raises(ChannelError, match="DropGroup: text lengths cover 3 of"):
        decode(_seal(t[0], [lengths, t[2]]))
    lengths[0], lengths[1] = -1, t[2].numel()  # None, where a str is declared
    with pytest.raises(ChannelError, match="DropGroup.group_id must be a str, got NoneType"):
        decode(_seal(t[0], [lengths, t[2]]))
    with pytest.raises(ChannelError, match=r"Rejected payload 0 \(ints\): 2 elements, expected 3"):
        decode(_seal(encode(rej)[0], [t[1], encode(rej)[2]]))


def test_register_batch_objective_is_a_non_empty_str():
    reg = RegisterBatch(1, "opd", {}, {"t": 2}, 0)
    for bad in ("", None, 3):
        with pytest.raises(ChannelError, match="RegisterBatch.objective must be a non-empty str"):
            encode(replace(reg, objective=bad))
    with pytest.raises(ChannelError, match="RegisterBatch.objective must be a non-empty str"):
        decode(_with_text(encode(reg), "objective", b""))
    assert decode(encode(replace(reg, objective="anything"))).objective == "anything"
    with pytest.raises(ChannelError, match="n_turns must map str trajectory ids to int"):
        decode(_with_text(encode(reg), "n_turns", b'{"t": true}'))
    with pytest.raises(ChannelError, match="schedule must be one of"):
        decode(_with_text(encode(reg), "schedule", b"eager"))


def test_timeout_keeps_link_and_shutdown_handshake():
    with link_pair(limits=Limits(max_tokens=2000)) as (rollout, learner):
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout, match="nothing arrived within 0.2 s"):
            learner.recv(0.2)
        assert time.monotonic() - t0 < 2
        assert learner.poll() is None  # nothing there: poll does not wait
        rollout.send(CloseBatch(version=1, rollout_time_s=0.5, n_sources=3))
        assert learner.recv(5) == CloseBatch(1, 0.5, 3)  # the timeout broke nothing
        rollout.send(CloseBatch(version=2, rollout_time_s=0.5, n_sources=3))
        deadline = time.monotonic() + 5
        while (got := learner.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.001)  # the reader queues it just after the send completes
        assert got == CloseBatch(2, 0.5, 3) and learner.poll() is None
        with pytest.raises(ChannelError, match="learner side does not send TrajectoryMsg"):
            learner.send(cw.bench_message(0))
        with pytest.raises(ChannelError, match="max_tokens=2000"):
            rollout.send(TrajectoryMsg(replace(cw.bench_message(0).source, tokens=(1,) * 2001,
                                               scored_mask=(0,) * 2001)))
        learner.send(Publish(1, "p"))
        assert rollout.recv(5) == Publish(1, "p")
        rollout.send(Shutdown("done"))
        assert learner.recv(5) == Shutdown("done")
        with pytest.raises(PeerGone, match="peer sent Shutdown"):
            learner.recv(5)
        with pytest.raises(PeerGone, match="peer sent Shutdown"):
            learner.poll()  # the end is sticky for poll too
        with pytest.raises(PeerGone):
            learner.send(Publish(2, "q"))
        assert rollout.recv(5) == Shutdown("reply")  # the automatic reply ends rollout's reader
        t0 = time.monotonic()
        rollout.close()
        learner.close()
        assert time.monotonic() - t0 < 2
        with pytest.raises(ChannelError, match="after close"):
            rollout.send(Ack(1, True))
        with pytest.raises(ChannelError, match="after close"):
            learner.poll()


def test_prepared_messages_arrive_as_sent_and_are_checked_when_prepared():
    long = TrajectoryMsg(replace(cw.bench_message(1).source, tokens=tuple(range(6000)),
                                 scored_mask=(0,) * 100 + (1,) * 5900))  # frame + body
    with link_pair(limits=Limits(max_tokens=8000)) as (rollout, learner):
        sent = [m for m in ALL_MESSAGES if isinstance(m, ROLLOUT_SENDS)
                and not isinstance(m, Shutdown)] + [long]
        prepared = [rollout.prepare(m) for m in sent]
        assert learner.poll() is None  # preparing sends nothing
        for p in prepared:
            rollout.send(p)
        assert [learner.recv(5) for _ in sent] == sent
        rollout.send(prepared[0])  # a prepared message may be sent again
        assert learner.recv(5) == sent[0]
        with pytest.raises(ChannelError, match="Shutdown is sent, not prepared"):
            rollout.prepare(Shutdown("x"))
        with pytest.raises(ChannelError, match="rollout side does not send Publish"):
            rollout.prepare(Publish(1, "p"))
        with pytest.raises(ChannelError, match="learner side does not send TrajectoryMsg"):
            learner.send(prepared[-1])
        with pytest.raises(ChannelError, match="max_tokens=8000"):
            rollout.prepare(TrajectoryMsg(replace(long.source, tokens=(1,) * 8001,
                                                  scored_mask=(0,) * 8001)))
        rollout.send(CloseBatch(version=1, rollout_time_s=0.5, n_sources=3))
        assert learner.recv(5) == CloseBatch(1, 0.5, 3)  # refused preparations sent nothing


def test_every_declared_type_crosses_a_link_from_its_side():
    with link_pair() as (rollout, learner):
        msgs = [m for m in edge_messages() if not isinstance(m, Shutdown)]
        for sender, receiver, may in ((rollout, learner, ROLLOUT_SENDS),
                                      (learner, rollout, LEARNER_SENDS)):
            mine = [m for m in msgs if isinstance(m, may)]
            for m in mine:
                sender.send(m)
            assert [receiver.recv(5) for _ in mine] == mine
        with pytest.raises(ChannelError, match="rollout side does not send Rejected"):
            rollout.send(Rejected(1, "g", "t", "why"))
        with pytest.raises(ChannelError, match="learner side does not send DropGroup"):
            learner.send(DropGroup(1, "g", "why"))


def _thread_policies() -> dict[int, int]:
    """tid → scheduling policy (0 normal, 1 FIFO, 3 batch) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[38])
        except FileNotFoundError:
            continue  # ended meanwhile
    return out


@pytest.mark.skipif(not realtime_io_permitted(),
                    reason="needs SCHED_FIFO: Linux and CAP_SYS_NICE, which this process lacks")
def test_realtime_io_runs_the_channel_threads_fifo_and_leaves_the_caller_alone():
    before = _thread_policies()
    mine = os.sched_getscheduler(0)
    with link_pair(realtime_io=True) as (rollout, learner):
        now = _thread_policies()
        readers = {learner._reader.native_id, rollout._reader.native_id}
        assert readers <= set(now) and not readers & set(before)
        # the readers are a link's only threads; the handshake's ended with the join
        assert {now[t] for t in readers} == {os.SCHED_FIFO}, now
        assert os.sched_getscheduler(0) == mine  # the calling thread got its policy back
        rollout.send(CloseBatch(version=1, rollout_time_s=0.5, n_sources=3))
        assert learner.recv(5) == CloseBatch(1, 0.5, 3)


def test_realtime_io_not_permitted_is_a_clear_error(monkeypatch):
    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with pytest.raises(ChannelError, match="learner rank 0: channel.realtime_io needs SCHED_FIFO"):
        open_learner_side("127.0.0.1", free_port(), 0, 1, timeout_s=1, realtime_io=True,
                          secret=cw.SECRET)
    with pytest.raises(ChannelError, match="rollout side: channel.realtime_io needs SCHED_FIFO"):
        open_rollout_side("127.0.0.1", free_port(), 1, timeout_s=1, realtime_io=True,
                          secret=cw.SECRET)
    assert not realtime_io_permitted()


def _raw_send(link, tensors: list[torch.Tensor]) -> None:
    """Bypass Link.send's checks, as a buggy peer that holds the secret would: the tensors
    framed and MACed as they are."""
    from tsync_mcore.channel.handshake import Mac
    from tsync_mcore.channel.link import _pack

    frame = _pack(tensors[0].tolist(), [t.numpy() for t in tensors[1:]])
    with link._send_lock:
        link._sock.sendall(frame.tobytes() + Mac.tag(link._send_mac.begin(frame), link._send_seq))
        link._send_seq += 1


@pytest.mark.parametrize("fault", ["bad magic", "damaged payload", "wrong direction"])
def test_protocol_error_is_final_and_told_to_the_peer(fault):
    with link_pair() as (rollout, learner):
        if fault == "bad magic":
            victim, peer = learner, rollout
            _raw_send(rollout, _tweak_header(encode(Shutdown("x")), 0, 7)[:1])
            pattern = "bad magic 0x7"
        elif fault == "damaged payload":  # one token flipped after the checksum was sealed
            victim, peer = learner, rollout
            tensors = encode(cw.bench_message(0))
            tensors[1] = tensors[1].clone()
            tensors[1][3] += 1
            _raw_send(rollout, tensors)
            pattern = "TrajectoryMsg: payload checksum mismatch"
        else:
            victim, peer = rollout, learner
            _raw_send(learner, encode(cw.bench_message(0)))
            pattern = "unexpected TrajectoryMsg from the learner side"
        for _ in range(2):  # final: raised again on every later recv
            with pytest.raises(ChannelError, match=pattern):
                victim.recv(5)
        told = peer.recv(5)
        assert isinstance(told, Shutdown) and "protocol error" in told.reason
        assert pattern.split()[0] in told.reason


def test_rendezvous_failures_are_named():
    with pytest.raises(ChannelTimeout, match="not reachable"):
        open_learner_side("127.0.0.1", free_port(), 0, 1, timeout_s=1, secret=cw.SECRET)
    port, box = free_port(), {}

    def host():
        try:
            open_rollout_side("127.0.0.1", port, 1, timeout_s=2, secret=cw.SECRET)
        except ChannelError as e:
            box["err"] = e

    th = threading.Thread(target=host)
    th.start()
    with pytest.raises(ChannelError, match="rollout expects 1 learner ranks, this learner was "
                                           "launched with 2"):
        open_learner_side("127.0.0.1", port, 0, 2, timeout_s=5, secret=cw.SECRET)
    th.join()
    assert isinstance(box.get("err"), ChannelTimeout) and "learner rank 0" in str(box["err"])


def test_free_port_is_below_the_ephemeral_range_and_not_seeded():
    """util/net.free_port draws outside the range where connect() and bind(0) take ports
    (so no outgoing connection takes it before the caller binds), from the OS's entropy
    (two processes that seed `random` alike draw different ports), and the port binds."""
    import random
    import socket

    from tsync_mcore.util import net

    low = net._ephemeral_low()
    random.seed(0)
    first = [net.free_port() for _ in range(8)]
    random.seed(0)
    again = [net.free_port() for _ in range(8)]
    assert first != again
    for port in first + again:
        assert net._LOW <= port < min(net._HIGH, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", first[0]))
