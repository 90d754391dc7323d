"""Links: one TCP connection per learner rank, authenticated with the run's shared secret.

The rollout process listens on (addr, port), bound to that address only; each learner rank
connects and runs the join handshake (handshake.py: wire version, learner rank, n_learners,
and a mutual proof of the secret). Then every message travels as one frame:

    header int64[16] | payloads, each padded to 8 bytes | HMAC-SHA256 tag (32 bytes)

The header announces the body's size; the reader checks it against `Limits` before it
allocates or reads a byte of the body, reads exactly that much, and checks the tag (keyed per
direction, over the header, the body and the direction's sequence number) before it decodes.
Nothing a peer sends can make a receiver abort: every violation is a `ChannelError`, told to
the peer as a protocol-error Shutdown.

Each Link owns a reader thread that takes every frame off the socket as it arrives, so a
sender never waits on the peer's main loop (a learner busy in backward), and `recv(timeout_s)`
is a queue wait: a timeout leaves the link intact. Nothing here touches torch.distributed,
which torchrun and Megatron own on the learner side.
"""

from __future__ import annotations

import errno
import hmac
import math
import os
import queue
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from tsync_mcore.channel.errors import ChannelError, ChannelTimeout, PeerGone
from tsync_mcore.channel.handshake import (
    TAG_BYTES, Keys, Mac, Refused, check_secret, learner_handshake, rollout_handshake,
)
from tsync_mcore.channel.messages import LEARNER_SENDS, ROLLOUT_SENDS, Message, Shutdown
from tsync_mcore.channel.wire import (
    DEFAULT_LIMITS, HEADER_LEN, SPECS, Limits, check_header_values, decode_arrays, encode_arrays,
)

_HEADER_BYTES = HEADER_LEN * 8
_CLOSE_GRACE_S = 5.0
_HANDSHAKE_S = 10.0  # one joiner's handshake; a silent one does not hold the others up
# The reader's socket waits in slices of this (a plain blocking wait would need its own fd
# flags, which it shares with the sender's socket); a slice ending is not an error.
_READ_SLICE_S = 3600.0
# Reason prefix of the Shutdown a reader sends when it stops on a malformed message; the
# receiver does not answer it (nobody would read the answer).
PROTOCOL_ERROR = "protocol error: "


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _layout(specs) -> list[tuple[np.dtype, int, int]]:
    """(numpy dtype, byte offset, byte size) of each payload in a packed body; each payload
    is padded to 8 bytes, so it can be viewed back in place."""
    out, at = [], 0
    for _, dt, n in specs:
        item = _NUMPY[dt]
        out.append((item, at, n * item.itemsize))
        at += _pad8(n * item.itemsize)
    return out


def _body_bytes(layout) -> int:
    return layout[-1][1] + _pad8(layout[-1][2]) if layout else 0


def _pack(header: list[int], payloads: list[np.ndarray]) -> np.ndarray:
    """Header and payloads of one message, packed as they travel (without the tag)."""
    n = sum(_pad8(p.nbytes) for p in payloads)
    out = np.zeros(_HEADER_BYTES + n, dtype=np.uint8)
    out[:_HEADER_BYTES] = np.array(header, dtype="<i8").view(np.uint8)
    at = _HEADER_BYTES
    for p in payloads:
        if p.size:
            out[at:at + p.nbytes] = np.ascontiguousarray(p).reshape(-1).view(np.uint8)
        at += _pad8(p.nbytes)
    return out


def _unpack(body: np.ndarray, layout) -> list[np.ndarray]:
    return [body[at:at + size].view(dt) for dt, at, size in layout]


# The declarations name torch dtypes; the link itself works in numpy.
_NUMPY = {torch.int64: np.dtype("<i8"), torch.uint8: np.dtype(np.uint8),
          torch.float64: np.dtype("<f8")}


def read_frame(sock: socket.socket, mac: Mac, seq: int, limits: Limits,
               hbuf: np.ndarray | None = None, patient: bool = False) -> Message:
    """Read and check one frame from `sock` (message number `seq` of its direction).
    ChannelError (PeerGone if the connection ends) for anything not a genuine message;
    `patient`: the socket's timeout is a read slice to wait through, not an error."""
    hbuf = np.empty(_HEADER_BYTES, dtype=np.uint8) if hbuf is None else hbuf
    _recv_into(sock, memoryview(hbuf), "before a message", patient)
    header = hbuf.view("<i8").tolist()
    kind, specs = check_header_values(header, limits)  # sizes checked before allocating
    layout = _layout(specs)
    n = _body_bytes(layout)
    body = np.empty(n + TAG_BYTES, dtype=np.uint8)
    _recv_into(sock, memoryview(body), f"inside a {SPECS[kind].name}", patient)
    tag = Mac.tag(mac.begin(hbuf, body[:n]), seq)
    if not _compare(tag, body[n:]):
        raise ChannelError(f"{SPECS[kind].name} (message {seq}) fails its MAC: tampered, "
                           f"injected, replayed or out of order")
    return decode_arrays(kind, header, _unpack(body[:n], layout))


def _compare(tag: bytes, got: np.ndarray) -> bool:
    return hmac.compare_digest(tag, got.tobytes())


def _recv_into(sock: socket.socket, view: memoryview, where: str, patient: bool) -> None:
    got = 0
    while got < len(view):
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if patient:
                continue  # a read slice ended: keep waiting
            raise ChannelTimeout(f"nothing more arrived {where}") from None
        except OSError as e:
            raise PeerGone(f"peer gone ({e.strerror or e})") from None
        if k == 0:
            raise PeerGone("peer gone (connection closed" +
                           (")" if got == 0 and where.startswith("before") else f" {where})"))
        got += k


@dataclass(frozen=True, eq=False)
class Prepared:
    """A message encoded, framed and mostly MACed ahead of its send (`Link.prepare`): sending
    it is the tag's last block and the socket write. A rollout that knows its messages before
    their release time (the overlap benchmark's simulator) encodes them while the learners are
    not waiting."""

    kind: type
    frame: np.ndarray  # header + body
    mac: object = field(repr=False)  # the HMAC state fed the frame, for the link it was made on
    link: object = field(repr=False)


class Link:
    """One learner ⇄ rollout link. `send` may be called from several threads."""

    def __init__(self, sock: socket.socket, keys: Keys, side: str, learner_rank: int,
                 timeout_s: float, limits: Limits = DEFAULT_LIMITS):
        self.side, self.learner_rank = side, learner_rank
        self.name = f"channel link {learner_rank} ({side} side)"
        self._sock = sock  # sends, under timeout_s
        self._rsock = sock.dup()  # the reader's: its own timeout (one read slice)
        sock.settimeout(timeout_s)
        self._rsock.settimeout(_READ_SLICE_S)
        self._send_mac, self._recv_mac = Mac(keys.send), Mac(keys.recv)
        self._send_seq = 0
        self._may_send = ROLLOUT_SENDS if side == "rollout" else LEARNER_SENDS
        self._may_recv = LEARNER_SENDS if side == "rollout" else ROLLOUT_SENDS
        self.timeout_s, self._limits = timeout_s, limits
        # (message or final error, perf_counter when the reader took it off the wire)
        self._inbox: queue.SimpleQueue[tuple[Message | ChannelError, float]] = queue.SimpleQueue()
        self.last_arrival: float = 0.0  # arrival time of the message recv() returned last
        self._send_lock = threading.Lock()
        self._sent_shutdown = False
        self._peer_shutdown: str | None = None  # the peer's Shutdown reason, once received
        self._send_error: ChannelError | None = None  # a failed send leaves the link dead
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name=self.name, daemon=True)
        self._reader.start()

    @property
    def peer_shutdown(self) -> str | None:
        """The reason the peer gave in its Shutdown, once one arrived (else None)."""
        return self._peer_shutdown

    # ------------------------------------------------------------ sending
    def prepare(self, msg: Message) -> Prepared:
        """Encode, frame and MAC `msg` now (checked as `send` would) for a later `send` on
        this link."""
        self._check_sendable(type(msg))
        if isinstance(msg, Shutdown):
            raise ChannelError(f"{self.name}: Shutdown is sent, not prepared")
        return self._frame(msg)

    def _frame(self, msg: Message) -> Prepared:
        frame = _pack(*encode_arrays(msg, self._limits))
        return Prepared(type(msg), frame, self._send_mac.begin(frame), self)

    def _check_sendable(self, kind: type) -> None:
        if not issubclass(kind, self._may_send):
            raise ChannelError(f"{self.name}: the {self.side} side does not send {kind.__name__}")

    def send(self, msg: Message | Prepared) -> None:
        """Deliver one message (or one `prepare`d); blocks while the socket cannot take it
        (≤ timeout_s)."""
        if self._closed:
            raise ChannelError(f"{self.name}: send after close")
        self._check_sendable(msg.kind if isinstance(msg, Prepared) else type(msg))
        if self._send_error is not None:
            raise type(self._send_error)(str(self._send_error))
        if self._peer_shutdown is not None:
            if isinstance(msg, Shutdown):
                return  # the reader has answered already (or the peer no longer reads)
            raise PeerGone(f"{self.name}: peer sent Shutdown ({self._peer_shutdown!r})")
        self._transmit(msg if isinstance(msg, Prepared) else self._frame(msg))

    def _transmit(self, msg: Prepared) -> None:
        kind = msg.kind
        mac = msg.mac if msg.link is self else self._send_mac.begin(msg.frame)
        with self._send_lock:
            if self._sent_shutdown:
                if kind is Shutdown:
                    return
                raise ChannelError(f"{self.name}: send of {kind.__name__} after Shutdown")
            if self._send_error is not None:
                raise type(self._send_error)(str(self._send_error))
            self._sent_shutdown = kind is Shutdown
            tag = Mac.tag(mac.copy(), self._send_seq)  # copy: a Prepared may be sent again
            try:
                _send_all(self._sock, [memoryview(msg.frame), tag])
            except TimeoutError:
                self._send_error = ChannelTimeout(
                    f"{self.name}: send {kind.__name__}: timed out after {self.timeout_s:g} s "
                    f"(the peer does not read)")
                raise self._send_error from None
            except OSError as e:
                self._send_error = PeerGone(f"{self.name}: send {kind.__name__}: peer gone "
                                            f"({e.strerror or e})")
                raise self._send_error from None
            self._send_seq += 1

    # ------------------------------------------------------------ receiving
    def recv(self, timeout_s: float | None = None) -> Message:
        """Next message. `None` waits the link's timeout_s, `math.inf` without limit.

        ChannelTimeout leaves the link usable; PeerGone / ChannelError are final (every
        later recv raises them again, after any messages that arrived before).
        """
        if self._closed:
            raise ChannelError(f"{self.name}: recv after close")
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            item, arrived = self._inbox.get(timeout=None if math.isinf(wait) else max(wait, 0.0))
        except queue.Empty:
            raise ChannelTimeout(f"{self.name}: nothing arrived within {wait:g} s") from None
        if isinstance(item, ChannelError):
            self._inbox.put((item, arrived))  # sticky: the link has ended
            raise type(item)(str(item))
        self.last_arrival = arrived
        return item

    def poll(self) -> Message | None:
        """The next message if one has arrived, else None (never waits); errors as recv."""
        if not self._closed and self._inbox.empty():
            return None
        return self.recv(timeout_s=math.inf)  # not empty, and only this thread takes from it

    def _read_loop(self) -> None:
        sock, seq = self._rsock, 0  # held by this thread: close() may drop the Link's reference
        hbuf = np.empty(_HEADER_BYTES, dtype=np.uint8)
        peer = "learner" if self.side == "rollout" else "rollout"
        try:
            while True:
                msg = read_frame(sock, self._recv_mac, seq, self._limits, hbuf, patient=True)
                seq += 1
                if not isinstance(msg, self._may_recv):
                    raise ChannelError(f"unexpected {type(msg).__name__} from the {peer} side")
                if isinstance(msg, Shutdown):
                    self._peer_shutdown = msg.reason  # before the app can see the message
                self._inbox.put((msg, time.perf_counter()))
                if isinstance(msg, Shutdown):
                    if not msg.reason.startswith(PROTOCOL_ERROR):  # that peer reads no more
                        self._reply_shutdown("reply")
                    end: ChannelError = PeerGone(
                        f"{self.name}: peer sent Shutdown ({msg.reason!r})")
                    break
        except PeerGone as e:
            end = PeerGone(f"{self.name}: recv: {e}")
            self._send_error = self._send_error or end  # TCP would take a write or two more
        except ChannelError as e:
            end = ChannelError(f"{self.name}: {e}")
            # Out of step with the peer: say why, rather than let its next send time out.
            self._reply_shutdown(f"{PROTOCOL_ERROR}{end}")
        self._inbox.put((end, time.perf_counter()))

    def _reply_shutdown(self, reason: str) -> None:
        # Our Shutdown is what lets the peer's reader (and its close()) finish.
        try:
            self._transmit(self._frame(Shutdown(reason[:4096])))
        except ChannelError:
            pass  # the peer is gone already: nothing to tell it

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Send Shutdown (unless one was exchanged), wait ≤ 5 s for the reader, close."""
        if self._closed:
            return
        try:
            self.send(Shutdown("closed"))
        except ChannelError:
            pass  # dead or already shut down: nothing to tell
        self._reader.join(min(self.timeout_s, _CLOSE_GRACE_S))
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a reader still waiting
        except OSError:
            pass  # not connected any more
        self._reader.join(1.0)
        self._sock.close()
        self._rsock.close()

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.name}{' closed' if self._closed else ''}>"


def _send_all(sock: socket.socket, parts: list) -> None:
    """sendall of several buffers in as few system calls as the socket takes them."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = sock.sendmsg(views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


# ---------------------------------------------------------------- rendezvous

@contextmanager
def _threads_created_realtime(enabled: bool):
    """Threads started inside inherit SCHED_FIFO (priority 1) from the calling thread, which
    gets its own policy back on exit.

    For a host whose cores the learner shares with the rollout and the channel (the CPU
    overlap benchmark): an I/O thread woken by a message then runs at once instead of
    waiting for a busy learner's time slice, and sleeps again as soon as it has delivered
    it (the release lags with and without: docs/measured/overlap.md). Linux only; needs
    CAP_SYS_NICE."""
    if not enabled:
        yield
        return
    prev = os.sched_getscheduler(0), os.sched_getparam(0)
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    try:
        yield
    finally:
        os.sched_setscheduler(0, *prev)


def realtime_io_permitted() -> bool:
    """Whether this process may run threads under SCHED_FIFO (see channel.realtime_io)."""
    try:
        with _threads_created_realtime(True):
            return True
    except (PermissionError, AttributeError, OSError):
        return False


def _require_realtime(who: str) -> None:
    if not realtime_io_permitted():
        raise ChannelError(f"{who}: channel.realtime_io needs SCHED_FIFO (Linux, CAP_SYS_NICE), "
                           f"which this process may not use")


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a message is one write
    return sock


def _say(line: str) -> None:
    print(f"[channel] {line}", file=sys.stderr, flush=True)


def open_rollout_side(addr: str, port: int, n_learners: int, timeout_s: float = 300,
                      limits: Limits = DEFAULT_LIMITS, realtime_io: bool = False, *,
                      secret: bytes, join_timeout_s: float | None = None) -> list[Link]:
    """Listen on (addr, port) only and wait for every learner rank; index = learner rank.
    A joiner that fails the handshake (wrong secret, version, n_learners, a rank already
    joined) is told why and refused; the wait goes on for the others until join_timeout_s
    (default timeout_s, which then bounds each link's sends).
    `realtime_io`: the links' reader threads run under SCHED_FIFO."""
    if n_learners < 1:
        raise ChannelError(f"n_learners must be ≥ 1, got {n_learners}")
    check_secret(secret)
    if realtime_io:
        _require_realtime("rollout side")
    where = f"{addr}:{port}"
    timeout_s, link_timeout_s = join_timeout_s or timeout_s, timeout_s
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port,
                                                              type=socket.SOCK_STREAM)[0]
        srv = socket.socket(family, kind, proto)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(sockaddr)
        srv.listen(max(16, 2 * n_learners))
    except OSError as e:
        taken = e.errno == errno.EADDRINUSE
        raise ChannelError(f"cannot host the channel at {where} ({e.strerror or e})"
                           + ("; another process holds the port: set channel.port (launch/run.py "
                              "and make demo pick a free one)" if taken else
                              "; check channel.addr / channel.port")) from None
    srv.settimeout(0.1)  # the accept loop checks for the end this often
    deadline = time.monotonic() + timeout_s
    done = threading.Condition()
    joined: dict[int, tuple[socket.socket, Keys]] = {}
    claimed: set[int] = set()
    refused: list[str] = []
    state = {"open": True}

    def claim(rank: int) -> bool:
        with done:
            if rank in claimed or not state["open"]:
                return False
            claimed.add(rank)
            return True

    def release(rank: int) -> None:
        with done:
            claimed.discard(rank)

    def join(conn: socket.socket, peer) -> None:
        conn.settimeout(max(0.1, min(_HANDSHAKE_S, deadline - time.monotonic())))
        try:
            rank, keys = rollout_handshake(_nodelay(conn), secret, n_learners, claim, release)
        except ChannelError as e:
            conn.close()
            why = f"{peer[0]}:{peer[1]}: {e}"
            with done:
                refused.append(why)
            _say(f"refused a joiner at {where} from {why}")
            return
        with done:
            if state["open"]:
                joined[rank] = (conn, keys)
                done.notify_all()
                return
        conn.close()  # the wait ended meanwhile

    def accept() -> None:
        while state["open"]:
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener closed
            threading.Thread(target=join, args=(conn, peer), name="tsync-join",
                             daemon=True).start()

    acceptor = threading.Thread(target=accept, name="tsync-accept", daemon=True)
    acceptor.start()
    with done:
        done.wait_for(lambda: len(joined) == n_learners, timeout=timeout_s)
        state["open"] = False
        missing = [i for i in range(n_learners) if i not in joined]
    acceptor.join()
    srv.close()  # one set of links per listener: a restarted learner needs a new rollout side
    if missing:
        for conn, _ in joined.values():
            conn.close()
        ranks = ", ".join(map(str, missing))
        raise ChannelTimeout(f"learner rank{'s' if len(missing) > 1 else ''} {ranks} did not join "
                             f"the channel at {where} within {timeout_s:g} s"
                             + (f" (refused: {'; '.join(refused[-3:])})" if refused else ""))
    with _threads_created_realtime(realtime_io):
        return [Link(joined[i][0], joined[i][1], "rollout", i, link_timeout_s, limits)
                for i in range(n_learners)]


def connect_learner(addr: str, port: int, learner_rank: int, n_learners: int, timeout_s: float,
                    secret: bytes) -> tuple[socket.socket, Keys]:
    """Connect to the rollout (retrying while nobody listens, up to timeout_s) and run the
    learner's half of the handshake: the socket and the link's keys."""
    where, deadline = f"{addr}:{port}", time.monotonic() + timeout_s
    said = False
    while True:
        try:
            sock = socket.create_connection((addr, port),
                                            timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as e:
            if not said and learner_rank == 0:  # once per learner, not per rank or retry
                said = True
                _say(f"learner: waiting for the rollout's channel at {where} (channel.addr, "
                     f"channel.port; up to {timeout_s:g} s: channel.join_timeout_s, else "
                     f"channel.timeout_s)")
            if time.monotonic() + 0.05 >= deadline:
                raise ChannelTimeout(f"learner rank {learner_rank}: the channel at {where} is not "
                                     f"reachable within {timeout_s:g} s ({e.strerror or e})"
                                     ) from None
            time.sleep(0.05)
    try:
        sock.settimeout(max(0.1, min(_HANDSHAKE_S, deadline - time.monotonic())))
        return sock, learner_handshake(_nodelay(sock), secret, learner_rank, n_learners, where)
    except ChannelError as e:
        sock.close()
        # A listener that is not a tsync rollout (bad magic, silence, a hang-up) or another
        # run's (authentication): say what answered at addr:port, not only why it failed.
        if isinstance(e, Refused) and "authenticat" not in str(e):
            raise  # a genuine rollout's refusal (rank taken, n_learners): its reason says it
        raise type(e)(f"{e}; the listener at {where} is not this run's rollout (another "
                      f"process or run on channel.port {port}?)") from None
    except BaseException:
        sock.close()
        raise


def open_learner_side(addr: str, port: int, learner_rank: int, n_learners: int,
                      timeout_s: float = 300, limits: Limits = DEFAULT_LIMITS,
                      realtime_io: bool = False, *, secret: bytes,
                      join_timeout_s: float | None = None) -> Link:
    """Join the rollout's channel (waiting for it up to join_timeout_s, default timeout_s)
    as `learner_rank`; the link's receives and sends then wait up to timeout_s.
    `realtime_io`: the link's reader runs under SCHED_FIFO; the calling thread keeps its
    policy."""
    if not 0 <= learner_rank < n_learners:
        raise ChannelError(f"learner_rank {learner_rank} outside [0, {n_learners})")
    check_secret(secret)
    if realtime_io:
        _require_realtime(f"learner rank {learner_rank}")
    sock, keys = connect_learner(addr, port, learner_rank, n_learners,
                                 join_timeout_s or timeout_s, secret)
    with _threads_created_realtime(realtime_io):
        return Link(sock, keys, "learner", learner_rank, timeout_s, limits)
