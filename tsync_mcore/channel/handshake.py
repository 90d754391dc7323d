"""The join handshake of a link, and the per-message MACs it keys.

    rollout → learner  hello: magic, wire version, n_learners, nonce_r
    learner → rollout  hello: magic, wire version, learner rank, n_learners, nonce_l,
                       proof_l = HMAC(secret, "learner" ‖ transcript)
    rollout → learner  verdict: refused?, proof_r = HMAC(secret, "rollout" ‖ transcript), reason
    learner → rollout  verdict: refused?, reason

transcript = (wire version, learner rank, n_learners, nonce_r, nonce_l). Each side proves it
holds the secret over a nonce the other just drew (multiprocessing.connection's challenge,
made mutual), so a recorded handshake cannot be replayed and neither side can be faked
without the secret. The session key HMAC(secret, "session" ‖ transcript) keys one MAC per
direction; every message carries HMAC-SHA256(direction key, header ‖ body ‖ seq), seq the
direction's message count, so a tampered, injected, replayed, reordered or reflected message
fails its check. Nothing is encrypted (see docs/design/wire.md, "Security model").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from tsync_mcore.channel.errors import ChannelError, ChannelTimeout, PeerGone
from tsync_mcore.channel.wire import WIRE_VERSION

MAGIC = b"tsync-hs"
NONCE_BYTES = TAG_BYTES = 32
MAX_REASON = 1024  # bytes of a verdict's reason
MIN_SECRET = 16

_ROLLOUT_HELLO = struct.Struct("<8sqq32s")  # magic, wire version, n_learners, nonce_r
_LEARNER_HELLO = struct.Struct("<8sqqq32s32s")  # magic, version, rank, n_learners, nonce, proof
_VERDICT = struct.Struct("<8sq32sq")  # magic, refused (0/1), proof (zeros if none), reason bytes
_TRANSCRIPT = struct.Struct("<qqq32s32s")
_NO_PROOF = bytes(TAG_BYTES)


class Refused(ChannelError):
    """A handshake that ended in a refusal (told to the peer where it could be)."""


@dataclass(frozen=True)
class Keys:
    """A link's two MAC keys, as seen from one side."""

    send: bytes
    recv: bytes


class Mac:
    """HMAC-SHA256 under one direction's key; `begin` returns a state to feed the message to."""

    def __init__(self, key: bytes):
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def begin(self, *parts) -> "hmac.HMAC":
        m = self._base.copy()  # the key's pads are hashed once, not per message
        for p in parts:
            m.update(p)
        return m

    @staticmethod
    def tag(state: "hmac.HMAC", seq: int) -> bytes:
        state.update(seq.to_bytes(8, "little"))
        return state.digest()


def check_secret(secret: bytes) -> None:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET:
        got = f"{len(secret)} bytes" if isinstance(secret, (bytes, bytearray)) else \
            type(secret).__name__
        raise ChannelError(f"channel secret must be at least {MIN_SECRET} bytes, got {got}")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _keys(secret: bytes, transcript: bytes, side: str) -> Keys:
    session = _mac(secret, b"tsync session\0", transcript)
    to_learner, to_rollout = _mac(session, b"rollout->learner"), _mac(session, b"learner->rollout")
    return Keys(to_learner, to_rollout) if side == "rollout" else Keys(to_rollout, to_learner)


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerGone(f"{what}: connection closed by the peer")
        got += k
    return bytes(buf)


def _send_verdict(sock: socket.socket, refused: bool, reason: str = "",
                  proof: bytes = _NO_PROOF) -> None:
    raw = reason.encode("utf-8", "replace")[:MAX_REASON]
    sock.sendall(_VERDICT.pack(MAGIC, int(refused), proof, len(raw)) + raw)


def _recv_verdict(sock: socket.socket, what: str) -> tuple[bool, bytes, str]:
    magic, refused, proof, n = _VERDICT.unpack(recv_exact(sock, _VERDICT.size, what))
    if magic != MAGIC or refused not in (0, 1) or not 0 <= n <= MAX_REASON:
        raise ChannelError(f"{what}: malformed handshake verdict")
    return bool(refused), proof, recv_exact(sock, n, what).decode("utf-8", "replace")


def _refuse(sock: socket.socket, reason: str) -> Refused:
    try:
        _send_verdict(sock, True, reason)
    except OSError:
        pass  # the peer left: nobody to tell
    return Refused(reason)


def _io(what: str, fn: Callable):
    """Run one handshake; socket failures become channel errors naming `what`."""
    try:
        return fn()
    except TimeoutError:
        raise ChannelTimeout(f"{what}: handshake timed out") from None
    except OSError as e:
        raise PeerGone(f"{what}: connection lost during the handshake ({e})") from None


def rollout_handshake(sock: socket.socket, secret: bytes, n_learners: int,
                      claim: Callable[[int], bool],
                      release: Callable[[int], None]) -> tuple[int, Keys]:
    """The rollout's half, on an accepted connection: (learner rank, keys). `claim(rank)`
    reserves a rank's slot (False: taken); a learner that refuses the rollout afterwards
    gives it back. Refused: what was refused and why (the joiner was told)."""
    what = "channel handshake"
    nonce_r = os.urandom(NONCE_BYTES)

    def run() -> tuple[int, Keys]:
        sock.sendall(_ROLLOUT_HELLO.pack(MAGIC, WIRE_VERSION, n_learners, nonce_r))
        magic, version, rank, n, nonce_l, proof = _LEARNER_HELLO.unpack(
            recv_exact(sock, _LEARNER_HELLO.size, what))
        if magic != MAGIC:
            raise _refuse(sock, "not a tsync channel learner (bad handshake magic)")
        if version != WIRE_VERSION:
            raise _refuse(sock, f"learner speaks wire version {version}, the rollout "
                                f"{WIRE_VERSION}")
        if n != n_learners:
            raise _refuse(sock, f"rollout expects {n_learners} learner ranks, this learner was "
                                f"launched with {n}")
        if not 0 <= rank < n_learners:
            raise _refuse(sock, f"learner rank {rank} outside [0, {n_learners})")
        transcript = _TRANSCRIPT.pack(version, rank, n, nonce_r, nonce_l)
        if not hmac.compare_digest(proof, _mac(secret, b"tsync learner\0", transcript)):
            raise _refuse(sock, f"learner rank {rank}: authentication failed (wrong channel "
                                f"secret)")
        if not claim(rank):
            raise _refuse(sock, f"learner rank {rank} already joined the channel")
        try:
            _send_verdict(sock, False, proof=_mac(secret, b"tsync rollout\0", transcript))
            refused, _, reason = _recv_verdict(sock, what)
        except BaseException:
            release(rank)
            raise
        if refused:
            release(rank)
            raise Refused(f"learner rank {rank} refused the rollout: {reason}")
        return rank, _keys(secret, transcript, "rollout")

    return _io(what, run)


def learner_handshake(sock: socket.socket, secret: bytes, learner_rank: int, n_learners: int,
                      where: str) -> Keys:
    """The learner's half, on a fresh connection to the rollout at `where`."""
    what = f"learner rank {learner_rank}: channel handshake with {where}"

    def run() -> Keys:
        magic, version, n, nonce_r = _ROLLOUT_HELLO.unpack(
            recv_exact(sock, _ROLLOUT_HELLO.size, what))
        if magic != MAGIC:
            raise ChannelError(f"{what}: not a tsync channel rollout (bad handshake magic)")
        nonce_l = os.urandom(NONCE_BYTES)
        transcript = _TRANSCRIPT.pack(WIRE_VERSION, learner_rank, n_learners, nonce_r, nonce_l)
        sock.sendall(_LEARNER_HELLO.pack(MAGIC, WIRE_VERSION, learner_rank, n_learners, nonce_l,
                                         _mac(secret, b"tsync learner\0", transcript)))
        refused, proof, reason = _recv_verdict(sock, what)
        if version != WIRE_VERSION:
            raise Refused(f"rollout speaks wire version {version}, this learner {WIRE_VERSION}")
        if refused:
            raise Refused(f"learner rank {learner_rank}: the rollout at {where} refused it: "
                          f"{reason}")
        if not hmac.compare_digest(proof, _mac(secret, b"tsync rollout\0", transcript)):
            raise _refuse(sock, f"learner rank {learner_rank}: the rollout at {where} failed to "
                                f"authenticate (wrong channel secret, or not the rollout)")
        _send_verdict(sock, False)
        return _keys(secret, transcript, "learner")

    return _io(what, run)
