"""Links: one 2-party gloo process group per learner rank, rendezvoused on a TCPStore.

The rollout process hosts the TCPStore (is_master) at (addr, port); link i is a
`ProcessGroupGloo` over `PrefixStore("tsync/link{i}", store)` with the rollout as rank 0 and
learner i as rank 1. Nothing here touches the default process group, which torchrun and
Megatron own on the learner side.

Each Link owns a reader thread that always has the next frame's recv posted. That matters
because a gloo send completes only once the peer has posted the matching recv: with the
reader, a sender never waits on the peer's main loop (a learner busy in backward), and
`recv(timeout_s)` is a queue wait, so a timeout leaves the link intact.
"""

from __future__ import annotations

import math
import os
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tsync_mcore.channel.errors import ChannelError, ChannelTimeout, PeerGone
from tsync_mcore.channel.messages import LEARNER_SENDS, ROLLOUT_SENDS, Message, Shutdown
from tsync_mcore.channel.wire import (
    DEFAULT_LIMITS, HEADER_LEN, WIRE_VERSION, Limits, check_header_values, decode_arrays, encode,
)

# A gloo wait that times out closes the pair, so the reader waits "forever" for the next
# header; a dead peer still surfaces at once (the socket closes).
_FOREVER = timedelta(days=365)
_FRAME_TAG = 0
_BODY_TAG = 1  # every tag has at most one send in flight
# Every message opens with one frame of exactly FRAME_BYTES: the header, then the packed
# payloads when they fit (every message but trajectories over ~3.6k tokens, turns over
# ~1.9k). One gloo op per message: the reader keeps the next frame's recv posted, so a send
# completes without a round trip to the receiver's Python thread (header, then the body's
# recv posted after decoding it, cost both sides ~0.2 ms of CPU per message more on this
# 2-core VM).
# A larger body follows the frame on its own tag.
FRAME_BYTES = 32 * 1024
_HEADER_BYTES = HEADER_LEN * 8


def _layout(specs) -> list[tuple[torch.dtype, int, int]]:
    """(dtype, byte offset, byte size) of each payload in a packed body; each payload is
    padded to 8 bytes, so it can be viewed back in place."""
    out, at = [], 0
    for _, dt, n in specs:
        size = n * dt.itemsize
        out.append((dt, at, size))
        at += -(-size // 8) * 8
    return out


def _body_bytes(specs) -> int:
    return sum(-(-size // 8) * 8 for _, _, size in _layout(specs))


def _frames(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(frame, separate body or None) for an encoded message [header, *payloads]."""
    payloads = [p.contiguous().view(torch.uint8).reshape(-1) for p in tensors[1:]]
    specs = [(None, torch.uint8, p.numel()) for p in payloads]
    n = _body_bytes(specs)
    fits = _HEADER_BYTES + n <= FRAME_BYTES
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[:_HEADER_BYTES] = tensors[0].view(torch.uint8)
    body = frame[_HEADER_BYTES:] if fits else torch.zeros(n, dtype=torch.uint8)
    for p, (_, at, size) in zip(payloads, _layout(specs)):
        body[at:at + size] = p
    return frame, None if fits else body


_NUMPY = {torch.int64: np.int64, torch.uint8: np.uint8, torch.float64: np.float64}


def _unpack(body: np.ndarray, specs) -> list[np.ndarray]:
    return [body[at:at + size].view(_NUMPY[dt]) for dt, at, size in _layout(specs)]


_CLOSE_GRACE_S = 5.0
# Reason prefix of the Shutdown a reader sends when it stops on a malformed message; the
# receiver does not answer it (nobody would read the answer).
PROTOCOL_ERROR = "protocol error: "


def _gloo_error(where: str, e: BaseException) -> ChannelError:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "imed out" in text or "timeout" in text.lower():
        return ChannelTimeout(f"{where}: timed out ({text})")
    return PeerGone(f"{where}: peer gone ({text})")


@dataclass(frozen=True, eq=False)
class Prepared:
    """A message encoded and framed ahead of its send (`Link.prepare`): sending it is the
    gloo op alone. A rollout that knows its messages before their release time (the
    overlap benchmark's simulator) encodes them while the learners are not waiting."""

    kind: type
    frame: torch.Tensor
    body: torch.Tensor | None


class Link:
    """One learner ⇄ rollout link. `send` may be called from several threads."""

    def __init__(self, pg: dist.ProcessGroup, store: dist.Store, side: str, learner_rank: int,
                 timeout_s: float, limits: Limits = DEFAULT_LIMITS):
        self.side, self.learner_rank = side, learner_rank
        self.name = f"channel link {learner_rank} ({side} side)"
        self._pg, self._store = pg, store
        self._peer = 1 if side == "rollout" else 0
        self._may_send = ROLLOUT_SENDS if side == "rollout" else LEARNER_SENDS
        self._may_recv = LEARNER_SENDS if side == "rollout" else ROLLOUT_SENDS
        self._timeout = timedelta(seconds=timeout_s)
        self.timeout_s, self._limits = timeout_s, limits
        # (message or final error, perf_counter when the reader took it off the wire)
        self._inbox: queue.SimpleQueue[tuple[Message | ChannelError, float]] = queue.SimpleQueue()
        self.last_arrival: float = 0.0  # arrival time of the message recv() returned last
        self._send_lock = threading.Lock()
        self._sent_shutdown = False
        self._peer_shutdown: str | None = None  # the peer's Shutdown reason, once received
        self._send_error: ChannelError | None = None  # a failed send leaves the pair closed
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name=self.name, daemon=True)
        self._reader.start()

    @property
    def peer_shutdown(self) -> str | None:
        """The reason the peer gave in its Shutdown, once one arrived (else None)."""
        return self._peer_shutdown

    # ------------------------------------------------------------ sending
    def prepare(self, msg: Message) -> Prepared:
        """Encode and frame `msg` now (checked as `send` would) for a later `send`."""
        self._check_sendable(type(msg))
        if isinstance(msg, Shutdown):
            raise ChannelError(f"{self.name}: Shutdown is sent, not prepared")
        return self._frame(msg)

    def _frame(self, msg: Message) -> Prepared:
        return Prepared(type(msg), *_frames(encode(msg, self._limits)))

    def _check_sendable(self, kind: type) -> None:
        if not issubclass(kind, self._may_send):
            raise ChannelError(f"{self.name}: the {self.side} side does not send {kind.__name__}")

    def send(self, msg: Message | Prepared) -> None:
        """Deliver one message (or one `prepare`d); blocks until the peer's reader took it
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
        with self._send_lock:
            if self._sent_shutdown:
                if kind is Shutdown:
                    return
                raise ChannelError(f"{self.name}: send of {kind.__name__} after Shutdown")
            self._sent_shutdown = kind is Shutdown
            try:
                works = [self._pg.send([msg.frame], self._peer, _FRAME_TAG)]
                if msg.body is not None:
                    works.append(self._pg.send([msg.body], self._peer, _BODY_TAG))
                for w in works:
                    w.wait(self._timeout)
            except RuntimeError as e:
                self._send_error = _gloo_error(f"{self.name}: send {kind.__name__}", e)
                raise self._send_error from None

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

    def _read_one(self, pg: dist.ProcessGroup) -> Message:
        # Numpy views of the receive buffer from here on: this thread wakes per message on
        # a learner's core, where each small torch op costs more than the numpy one.
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        pg.recv([frame], self._peer, _FRAME_TAG).wait(_FOREVER)
        raw = frame.numpy()
        header = raw[:_HEADER_BYTES].view(np.int64).tolist()
        kind, specs = check_header_values(header, self._limits)  # sizes checked before allocating
        n = _body_bytes(specs)
        if _HEADER_BYTES + n <= FRAME_BYTES:
            body = raw[_HEADER_BYTES:_HEADER_BYTES + n]
        else:
            received = torch.empty(n, dtype=torch.uint8)
            pg.recv([received], self._peer, _BODY_TAG).wait(self._timeout)
            body = received.numpy()
        return decode_arrays(kind, header, _unpack(body, specs))

    def _read_loop(self) -> None:
        pg = self._pg  # held by this thread: close() may drop the Link's reference
        try:
            while True:
                msg = self._read_one(pg)
                if not isinstance(msg, self._may_recv):
                    raise ChannelError(f"{self.name}: unexpected {type(msg).__name__} from the "
                                       f"{'learner' if self.side == 'rollout' else 'rollout'} side")
                if isinstance(msg, Shutdown):
                    self._peer_shutdown = msg.reason  # before the app can see the message
                self._inbox.put((msg, time.perf_counter()))
                if isinstance(msg, Shutdown):
                    if not msg.reason.startswith(PROTOCOL_ERROR):  # that peer reads no more
                        self._reply_shutdown("reply")
                    end: ChannelError = PeerGone(
                        f"{self.name}: peer sent Shutdown ({msg.reason!r})")
                    break
        except ChannelError as e:
            end = e
            # Out of step with the peer: say why, rather than let its next send time out.
            self._reply_shutdown(f"{PROTOCOL_ERROR}{e}")
        except RuntimeError as e:
            end = _gloo_error(f"{self.name}: recv", e)
        self._inbox.put((end, time.perf_counter()))

    def _reply_shutdown(self, reason: str) -> None:
        # Our Shutdown is what lets the peer's reader (and its close()) finish.
        try:
            self._transmit(self._frame(Shutdown(reason[:4096])))
        except ChannelError:
            pass  # the peer is gone already: nothing to tell it

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Send Shutdown (unless one was exchanged), wait ≤ 5 s for the reader, drop the group."""
        if self._closed:
            return
        try:
            self.send(Shutdown("closed"))
        except ChannelError:
            pass  # dead or already shut down: nothing to tell
        self._reader.join(min(self.timeout_s, _CLOSE_GRACE_S))
        self._closed = True
        # A reader still blocked (the peer neither replied nor died) keeps the group alive
        # until the process exits; it is a daemon thread and holds nothing else.
        self._pg, self._store = None, None

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.name}{' closed' if self._closed else ''}>"


# ---------------------------------------------------------------- rendezvous

@contextmanager
def _threads_created_realtime(enabled: bool):
    """Threads started inside inherit SCHED_FIFO (priority 1) from the calling thread, which
    gets its own policy back on exit.

    For a host whose cores the learner shares with the rollout and the channel (the CPU
    overlap benchmark): an I/O thread woken by a message then runs at once instead of
    waiting for a busy learner's time slice (a release was delayed by up to 230 ms there),
    and it sleeps again within ~1 ms. Linux only; needs CAP_SYS_NICE."""
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


def _local_ip_towards(addr: str, port: int) -> str:
    """The local address the OS routes to `addr` (no packet is sent: UDP connect)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def _gloo_group(store: dist.Store, learner_rank: int, rank: int, host: str,
                timeout_s: float) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)  # connect timeout; waits pass their own
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
                     if ifname else dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._threads = 1  # point-to-point only; the collective worker threads stay idle
    return dist.ProcessGroupGloo(dist.PrefixStore(f"tsync/link{learner_rank}", store), rank, 2,
                                 opts)


def open_rollout_side(addr: str, port: int, n_learners: int, timeout_s: float = 300,
                      limits: Limits = DEFAULT_LIMITS, realtime_io: bool = False) -> list[Link]:
    """Host the rendezvous and wait for every learner rank; index = learner rank.
    `realtime_io`: the links' threads (gloo I/O, readers) run under SCHED_FIFO."""
    if n_learners < 1:
        raise ChannelError(f"n_learners must be ≥ 1, got {n_learners}")
    if realtime_io:
        _require_realtime("rollout side")
    try:
        store = dist.TCPStore(addr, port, None, True, timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise ChannelError(f"cannot host the channel rendezvous at {addr}:{port} ({e})") from None
    store.set("tsync/wire_version", str(WIRE_VERSION))
    store.set("tsync/n_learners", str(n_learners))
    host = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][4][0]  # gloo binds here

    def build(i: int) -> dist.ProcessGroup:
        try:
            return _gloo_group(store, i, 0, host, timeout_s)
        except RuntimeError as e:
            raise ChannelTimeout(f"learner rank {i} did not join the channel at {addr}:{port} "
                                 f"within {timeout_s:g} s ({str(e).splitlines()[0]})") from None

    # Learners arrive in any order; build all links at once so none waits behind another.
    with _threads_created_realtime(realtime_io):
        with ThreadPoolExecutor(n_learners, thread_name_prefix="tsync-link") as ex:
            pgs = list(ex.map(build, range(n_learners)))
        return [Link(pg, store, "rollout", i, timeout_s, limits) for i, pg in enumerate(pgs)]


def open_learner_side(addr: str, port: int, learner_rank: int, n_learners: int,
                      timeout_s: float = 300, limits: Limits = DEFAULT_LIMITS,
                      realtime_io: bool = False) -> Link:
    """Join the rollout's rendezvous (waiting for it up to timeout_s) as `learner_rank`.
    `realtime_io`: the link's threads (gloo I/O, reader) run under SCHED_FIFO; the
    calling thread keeps its policy."""
    if not 0 <= learner_rank < n_learners:
        raise ChannelError(f"learner_rank {learner_rank} outside [0, {n_learners})")
    if realtime_io:
        _require_realtime(f"learner rank {learner_rank}")
    try:
        store = dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        wire, n = (store.get(k).decode() for k in ("tsync/wire_version", "tsync/n_learners"))
    except (RuntimeError, OSError) as e:
        raise ChannelTimeout(f"learner rank {learner_rank}: channel rendezvous at {addr}:{port} "
                             f"not reachable within {timeout_s:g} s ({e})") from None
    if wire != str(WIRE_VERSION):
        raise ChannelError(f"rollout speaks wire version {wire}, this learner {WIRE_VERSION}")
    if n != str(n_learners):
        raise ChannelError(f"rollout expects {n} learner ranks, this learner was launched with "
                           f"{n_learners}")
    with _threads_created_realtime(realtime_io):
        try:
            pg = _gloo_group(store, learner_rank, 1, _local_ip_towards(addr, port), timeout_s)
        except RuntimeError as e:
            raise ChannelTimeout(
                f"learner rank {learner_rank}: link to the rollout at {addr}:{port} not built "
                f"within {timeout_s:g} s ({str(e).splitlines()[0]})") from None
        return Link(pg, store, "learner", learner_rank, timeout_s, limits)
