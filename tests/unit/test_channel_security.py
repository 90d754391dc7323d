"""Channel hardening: the secret file, who may join, what a peer's bytes can do, Publish paths.

Every attack here runs against the real listener, handshake and reader: impostors and raw
peers are plain sockets speaking (or mangling) the protocol.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.channel_shared import ALL_MESSAGES
from tests.helpers.dist_util import free_port
from tests.helpers.links import link_pair
from tests.helpers.workers import channel_worker as cw  # noqa: E402  (tests/workers, on the path via test_channel)
from tsync_mcore.channel import (
    WIRE_VERSION,
    Ack,
    ChannelError,
    ChannelTimeout,
    CloseBatch,
    Limits,
    Message,
    PeerGone,
    Publish,
    Shutdown,
    check_header_values,
    load_or_create_secret,
    open_learner_side,
    open_rollout_side,
)
from tsync_mcore.channel import handshake as hs
from tsync_mcore.channel.handshake import Mac
from tsync_mcore.channel.link import (
    _HEADER_BYTES,
    PROTOCOL_ERROR,
    _pack,
    connect_learner,
    read_frame,
)
from tsync_mcore.channel.secret import load_secret
from tsync_mcore.channel.wire import encode_arrays

WRONG = b"not the run's secret, same length"


def test_secret_file_is_created_private_reused_and_checked(tmp_path):
    path = str(tmp_path / "run" / "channel.secret")
    key = load_or_create_secret(path)
    assert len(key) == 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_secret(path) == key  # reused, not replaced
    assert os.listdir(tmp_path / "run") == ["channel.secret"]  # no temp file left behind
    os.chmod(path, 0o640)
    with pytest.raises(ChannelError, match=f"channel secret {path}: mode 0640 lets group/other"):
        load_or_create_secret(path)
    os.chmod(path, 0o600)
    link = str(tmp_path / "link.secret")
    os.symlink(path, link)
    with pytest.raises(ChannelError, match=f"channel secret {link}: is a symlink"):
        load_or_create_secret(link)
    bad = tmp_path / "bad.secret"
    bad.write_text("zz not hex\n")
    bad.chmod(0o600)
    with pytest.raises(ChannelError, match="bad.secret: not a hex string"):
        load_secret(str(bad))
    bad.write_text("abcd\n")
    with pytest.raises(ChannelError, match="bad.secret: 2 bytes, need at least 16"):
        load_secret(str(bad))
    with pytest.raises(ChannelError, match="not a regular file"):
        os.mkfifo(tmp_path / "fifo", 0o600)
        load_secret(str(tmp_path / "fifo"))


@contextmanager
def rollout_thread(port: int, n: int = 1, timeout_s: float = 15, secret: bytes = cw.SECRET):
    """open_rollout_side in a thread; box["links"] or box["err"] once it returned."""
    box: dict = {}

    def run():
        try:
            box["links"] = open_rollout_side("127.0.0.1", port, n, timeout_s, secret=secret)
        except ChannelError as e:
            box["err"] = e

    th = threading.Thread(target=run)
    th.start()
    try:
        yield box, th
    finally:
        th.join()
        for link in box.get("links", []):
            link.close()


def _wait_listening(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError("the rollout never listened")


def test_listens_on_the_configured_address_only():
    port = free_port()
    with rollout_thread(port, timeout_s=5) as (box, th):
        _wait_listening(port)  # 127.0.0.1 answers ...
        for other in ("127.0.0.2", "127.1.2.3"):  # ... other local addresses do not
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, port), timeout=2)
        learner = open_learner_side("127.0.0.1", port, 0, 1, 10, secret=cw.SECRET)
        th.join()
        box["links"][0].send(CloseBatch(1, 0.5, 3))
        assert learner.recv(5) == CloseBatch(1, 0.5, 3)
        learner.close()


def test_impostor_learner_is_refused_and_the_honest_one_joins(capfd):
    port = free_port()
    with rollout_thread(port) as (box, th):
        with pytest.raises(ChannelError, match="refused it: learner rank 0: authentication "
                                               "failed \\(wrong channel secret\\)"):
            open_learner_side("127.0.0.1", port, 0, 1, 10, secret=WRONG)
        with socket.create_connection(("127.0.0.1", port)) as raw:  # garbage instead of a hello
            hs.recv_exact(raw, hs._ROLLOUT_HELLO.size, "test")
            raw.sendall(os.urandom(hs._LEARNER_HELLO.size))
            refused, _, reason = hs._recv_verdict(raw, "test")
            assert refused and "bad handshake magic" in reason
        learner = open_learner_side("127.0.0.1", port, 0, 1, 10, secret=cw.SECRET)
        th.join()
        (rollout,) = box["links"]
        learner.send(Publish(1, "p"))
        assert rollout.recv(5) == Publish(1, "p")
        learner.close()
    err = capfd.readouterr().err
    assert err.count("[channel] refused a joiner") == 2 and "wrong channel secret" in err


def test_wrong_version_rank_and_duplicate_are_refused_with_reasons():
    port = free_port()
    with rollout_thread(port, n=2) as (box, th):
        first = open_learner_side("127.0.0.1", port, 0, 2, 10, secret=cw.SECRET)
        with pytest.raises(ChannelError, match="learner rank 0 already joined the channel"):
            open_learner_side("127.0.0.1", port, 0, 2, 10, secret=cw.SECRET)
        with pytest.raises(ChannelError, match="rollout expects 2 learner ranks, this learner "
                                               "was launched with 3"):
            open_learner_side("127.0.0.1", port, 2, 3, 10, secret=cw.SECRET)
        with socket.create_connection(("127.0.0.1", port)) as raw:  # an older learner
            hs.recv_exact(raw, hs._ROLLOUT_HELLO.size, "test")
            raw.sendall(hs._LEARNER_HELLO.pack(hs.MAGIC, WIRE_VERSION - 1, 1, 2, bytes(32),
                                               bytes(32)))
            refused, _, reason = hs._recv_verdict(raw, "test")
            assert refused and reason == (f"learner speaks wire version {WIRE_VERSION - 1}, "
                                          f"the rollout {WIRE_VERSION}")
        second = open_learner_side("127.0.0.1", port, 1, 2, 10, secret=cw.SECRET)
        th.join()
        assert [link.learner_rank for link in box["links"]] == [0, 1]
        for learner in (first, second):
            learner.close()


def test_rollout_with_the_wrong_secret_is_refused_by_both_sides():
    port = free_port()
    with rollout_thread(port, timeout_s=3, secret=WRONG) as (box, th):
        with pytest.raises(ChannelError, match="wrong channel secret"):
            open_learner_side("127.0.0.1", port, 0, 1, 10, secret=cw.SECRET)
        th.join()
    assert isinstance(box["err"], ChannelTimeout)
    assert "learner rank 0 did not join" in str(box["err"])
    assert "authentication failed (wrong channel secret)" in str(box["err"])


def test_fake_rollout_cannot_pass_for_the_rollout():
    # A fake that accepts any learner and answers with a made-up proof.
    srv = socket.create_server(("127.0.0.1", 0))
    port, told = srv.getsockname()[1], {}

    def fake():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(hs._ROLLOUT_HELLO.pack(hs.MAGIC, WIRE_VERSION, 1, os.urandom(32)))
            hs.recv_exact(conn, hs._LEARNER_HELLO.size, "fake")
            hs._send_verdict(conn, False, proof=os.urandom(32))
            told["verdict"] = hs._recv_verdict(conn, "fake")

    th = threading.Thread(target=fake)
    th.start()
    with pytest.raises(ChannelError, match="the rollout at 127.0.0.1:.* failed to authenticate"):
        open_learner_side("127.0.0.1", port, 0, 1, 10, secret=cw.SECRET)
    th.join()
    srv.close()
    refused, _, reason = told["verdict"]
    assert refused and "failed to authenticate" in reason


@contextmanager
def raw_learner(limits: Limits = Limits(), timeout_s: float = 10):
    """(rollout link, raw socket of a genuine learner, its send Mac, its recv Mac)."""
    port = free_port()
    with rollout_thread(port) as (box, th):
        sock, keys = connect_learner("127.0.0.1", port, 0, 1, timeout_s, cw.SECRET)
        th.join()
        with sock:
            yield box["links"][0], sock, Mac(keys.send), Mac(keys.recv)


def _told(sock: socket.socket, mac: Mac) -> Shutdown:
    """What the rollout said on the raw learner's socket (its first message)."""
    sock.settimeout(10)
    msg = read_frame(sock, mac, 0, Limits())
    assert isinstance(msg, Shutdown)
    return msg


def _frame(msg: Message) -> np.ndarray:
    return _pack(*encode_arrays(msg))


@pytest.mark.parametrize("fault", ["oversized", "huge frame", "longer body", "garbage tag",
                                   "tampered", "replayed", "reordered"])
def test_a_bad_frame_is_a_protocol_error_told_to_the_sender(fault):
    good = _frame(Publish(1, "/p/θ"))
    with raw_learner() as (rollout, sock, send_mac, recv_mac):
        if fault == "oversized":  # a header announcing more than the Limits allow
            h, p = encode_arrays(Publish(1, "x" * 10))
            h[6] = ((64 << 20) + 1 << 8) | 2
            h[15] = sum(h[:15]) % (1 << 62)
            sock.sendall(np.array(h, dtype="<i8").tobytes())
            want = "text: path, method\\): 67108865 elements, over the limit max_bytes"
        elif fault == "huge frame":  # 1 MiB of whatever, where a frame starts
            sock.settimeout(3)
            try:
                sock.sendall(os.urandom(1 << 20))
            except TimeoutError:
                pass  # the receiver stopped reading after the first 128 bytes
            want = "bad magic"
        elif fault == "longer body":  # a genuine message, then bytes nobody announced
            sock.sendall(good.tobytes() + Mac.tag(send_mac.begin(good), 0) + b"\x01" * 300)
            assert rollout.recv(5) == Publish(1, "/p/θ")
            want = "bad magic"
        elif fault == "garbage tag":
            sock.sendall(good.tobytes() + os.urandom(32))
            want = "Publish \\(message 0\\) fails its MAC"
        elif fault == "tampered":  # one byte flipped after the MAC was computed
            tag = Mac.tag(send_mac.begin(good), 0)
            bad = good.copy()
            bad[-3] ^= 0x20  # inside the text payload: its checksum would catch it too
            sock.sendall(bad.tobytes() + tag)
            want = "Publish \\(message 0\\) fails its MAC"
        elif fault == "replayed":
            frame = good.tobytes() + Mac.tag(send_mac.begin(good), 0)
            sock.sendall(frame + frame)
            assert rollout.recv(5) == Publish(1, "/p/θ")
            want = "Publish \\(message 1\\) fails its MAC"
        else:  # message 1 sent first
            sock.sendall(good.tobytes() + Mac.tag(send_mac.begin(good), 1))
            want = "Publish \\(message 0\\) fails its MAC"
        for _ in range(2):  # final on the receiver
            with pytest.raises(ChannelError, match=want):
                rollout.recv(5)
        told = _told(sock, recv_mac)
        assert told.reason.startswith(PROTOCOL_ERROR) and "channel link 0 (rollout side)" in \
            told.reason
        with pytest.raises(ChannelError, match="after Shutdown"):  # the link is over
            rollout.send(Ack(1, True))


def test_a_peer_that_vanishes_mid_frame_is_peer_gone():
    with raw_learner() as (rollout, sock, send_mac, _):
        sock.sendall(_frame(Publish(1, "p" * 100)).tobytes()[:200])
        sock.close()
        with pytest.raises(PeerGone, match="connection closed inside a Publish"):
            rollout.recv(5)


_SAMPLES = [m for m in ALL_MESSAGES if not isinstance(m, Shutdown)] + [Shutdown("x ✓")]
_mutations = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6)


def _mutate(raw: bytes, flips, cut: int | None, extra: bytes) -> bytes:
    b = bytearray(raw)
    for at, v in flips:
        b[at % len(b)] = v
    return bytes(b[:cut] if cut is not None else b) + extra


def _read(data: bytes, mac: Mac, limits: Limits = Limits()) -> Message | ChannelError:
    a, b = socket.socketpair()

    def write():
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader stopped early and closed the pair

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        return read_frame(b, mac, 0, limits)
    except ChannelError as e:
        return e
    finally:
        b.close()
        writer.join()
        a.close()


_FUZZ = settings(max_examples=200, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.sampled_from(range(len(_SAMPLES))), _mutations,
       st.one_of(st.none(), st.integers(0, 1 << 16)), st.binary(max_size=64))
def test_fuzz_mutated_frames_with_their_original_tag(i, flips, cut, extra):
    """What a network (or an attacker without the key) can do: never more than ChannelError."""
    msg, mac = _SAMPLES[i], Mac(cw.SECRET)
    frame = _frame(msg).tobytes()
    data = _mutate(frame + Mac.tag(mac.begin(frame), 0), flips, cut, extra)
    got = _read(data, mac)
    assert isinstance(got, ChannelError) or got == msg, got


@_FUZZ
@given(st.sampled_from(range(len(_SAMPLES))), _mutations,
       st.one_of(st.none(), st.integers(0, 1 << 16)))
def test_fuzz_mutated_frames_sealed_by_a_peer_with_the_key(i, flips, cut):
    """What a buggy peer holding the key can do: the decoder itself must hold, with the MAC
    passing over whatever it sends."""
    frame = _mutate(_frame(_SAMPLES[i]).tobytes(), flips, cut, b"")
    mac = Mac(cw.SECRET)
    got = _read(frame + Mac.tag(mac.begin(frame), 0), mac, Limits(max_tokens=4096,
                                                                   max_bytes=4096))
    assert isinstance(got, (ChannelError, Message)), got


@_FUZZ
@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=16, max_size=16),
       st.sampled_from(range(len(_SAMPLES))), st.integers(0, 15))
def test_fuzz_header_values(h, i, keep):
    """Random header values, alone or spliced into a genuine header, never raise more."""
    real, _ = encode_arrays(_SAMPLES[i])
    for values in (h, real[:keep] + h[keep:]):
        try:
            check_header_values(values)
        except ChannelError:
            pass


def test_fuzz_checks_really_reach_the_decoder():
    # The sealed fuzz must exercise decode, not only the header: a payload byte changed and
    # sealed again is a checksum error of the decoder, named as such.
    frame = _frame(_SAMPLES[0]).tobytes()
    mac = Mac(cw.SECRET)
    bad = _mutate(frame, [(_HEADER_BYTES, 0xFF)], None, b"")  # the first payload byte
    got = _read(bad + Mac.tag(mac.begin(bad), 0), mac)
    assert isinstance(got, ChannelError) and "checksum" in str(got)


def test_rollout_loads_only_what_is_under_the_publish_dir(tmp_path):
    pytest.importorskip("transformers")
    from tsync_mcore.rollout.driver import RolloutStopped, await_publish

    pub = tmp_path / "publish"
    pub.mkdir()
    (pub / "policy_v1.safetensors").write_bytes(b"")
    os.symlink("/etc/hostname", pub / "policy_v2.safetensors")
    with link_pair() as (rollout, learner):
        learner.send(Publish(1, str(pub / "policy_v1.safetensors")))
        assert await_publish(rollout, 1, 5, str(pub)) == Publish(1, str(pub / "policy_v1.safetensors"))
    for path in (str(tmp_path / "elsewhere.safetensors"), str(pub / ".." / "x"),
                 str(pub / "policy_v2.safetensors"), str(pub), "", "a\0b"):
        with link_pair() as (rollout, learner):
            learner.send(Publish(1, path))
            with pytest.raises(RolloutStopped) as err:
                await_publish(rollout, 1, 5, str(pub))
            assert repr(path) in str(err.value) and "publish.dir" in str(err.value)
            ack = learner.recv(5)
            assert isinstance(ack, Ack) and not ack.ok and ack.error == str(err.value)


def test_a_short_or_missing_secret_is_refused_before_any_connection():
    for bad, got in ((b"short", "5 bytes"), ("a str secret of enough length", "str")):
        with pytest.raises(ChannelError, match=f"at least 16 bytes, got {got}"):
            open_learner_side("127.0.0.1", free_port(), 0, 1, 1, secret=bad)
        with pytest.raises(ChannelError, match=f"at least 16 bytes, got {got}"):
            open_rollout_side("127.0.0.1", free_port(), 1, 1, secret=bad)
