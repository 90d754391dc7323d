"""The OpenAI endpoint's connections: how many it holds at once, which one gives way when
it is full, its own accept loop, and uvicorn's protocol with a deadline on each request's
headers.

An endpoint that accepted every connection would run out of descriptors (the agents' tool
calls and processes need theirs) and then out of log: asyncio's accept loop logs every
failed accept with its traceback, up to a backlog's worth per wake-up. Here the endpoint
holds at most a cap of connections, well under the open-file limit (its soft limit raised
to the hard one where allowed); at the cap a new connection takes the place of the oldest
idle one whose requests never authenticated (one that sent nothing, or only headers so
far; an authenticated idle one only when there is none), or, with no idle one, gets a
one-line 503 and is closed. The server also bounds each trajectory's requests in flight,
so no key holds the cap busy. A shortage of descriptors or
buffers pauses accepting for a moment and is said once per condition, never per accept.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import socket
from collections.abc import Callable
from typing import Any

MAX_CAP = 4096  # connections at most, whatever the open-file limit
ACCEPT_BATCH = 64  # accepts per wake-up, so one burst does not hold the loop
PAUSE_S = 0.5  # accepting pauses this long when the process is short of a resource
CONNECTION = "tsync.connection"  # a request scope's extension: the protocol that carries it
SHORT_OF = {errno.EMFILE: "EMFILE", errno.ENFILE: "ENFILE", errno.ENOBUFS: "ENOBUFS",
            errno.ENOMEM: "ENOMEM"}


def raise_open_files() -> int:
    """Raise this process's soft open-file limit to its hard one where allowed; the soft
    limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:  # the kernel's own ceiling
        try:
            with open("/proc/sys/fs/nr_open") as f:
                hard = int(f.read())
        except (OSError, ValueError):
            return soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    return soft


def connection_cap() -> int:
    """Connections served at once: half the open-file limit, at least 64, at most 4096."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(64, min(MAX_CAP, (soft if soft > 0 else 1024) // 2))


def _idle(p: Any) -> bool:
    """No request in progress on uvicorn protocol `p`: no complete headers yet, or the
    last response sent."""
    import h11

    cycle = getattr(p, "cycle", None)
    return p.conn.their_state is h11.IDLE and (cycle is None or cycle.response_complete)


class Connections:
    """The endpoint's open connections, oldest first, within `cap`; see the module
    docstring. `trust(scope)` marks the connection of a request's scope as one whose
    request authenticated: idle, it gives way only when no untrusted one is idle (a client
    reconnects an idle keep-alive connection the server closed)."""

    def __init__(self, cap: int, say: Callable[[str], None] = print) -> None:
        self.cap, self.say = cap, say
        self.open: dict[Any, None] = {}  # uvicorn protocols, oldest first
        self.pending = 0  # accepted, their protocol not made yet
        self.counts = dict(evicted=0, refused=0, accept_errors=0)
        self._said: set[str] = set()

    def __len__(self) -> int:
        return len(self.open) + self.pending

    def once(self, condition: str, line: str) -> None:
        """Say `line` the first time `condition` happens (it is counted every time)."""
        if condition not in self._said:
            self._said.add(condition)
            self.say(line)

    def admit(self) -> bool:
        """Room for one more connection (at the cap, an idle one closed to make it);
        False: the new one must be refused."""
        if len(self) >= self.cap:
            victim = self._victim()
            self.once("full", f"[rollout] OpenAI endpoint: {self.cap} connections open (its "
                              f"cap: rollout.openai_max_connections, or half the open-file "
                              f"limit): idle ones (unauthenticated first) give way to new "
                              f"ones, else new ones get 503 (counted: rollout/openai_"
                              f"connections_*)")
            if victim is None:
                self.counts["refused"] += 1
                return False
            self.counts["evicted"] += 1
            self.lost(victim)
            victim.transport.close()
        self.pending += 1
        return True

    def _victim(self) -> Any:
        """The oldest idle untrusted connection, else the oldest idle one, else None."""
        first = None
        for p in self.open:
            if _idle(p):
                if not getattr(p, "trusted", False):
                    return p
                if first is None:
                    first = p
        return first

    def made(self, p: Any) -> None:
        self.pending -= 1
        self.open[p] = None

    def lost(self, p: Any) -> None:
        self.open.pop(p, None)

    @staticmethod
    def trust(scope: dict) -> None:
        """The connection that carried the request of ASGI `scope` authenticated."""
        p = scope.get("extensions", {}).get(CONNECTION)
        if p is not None:
            p.trusted = True


REFUSAL = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n" \
          "Content-Length: {n}\r\nConnection: close\r\n\r\n{body}"


def _refuse(conn: socket.socket, cap: int) -> None:
    """A one-line 503 (best effort: the socket's buffer takes it or not), then closed."""
    body = json.dumps({"error": {"message": f"the endpoint holds {cap} connections, its "
                                            f"cap, none of them idle: retry shortly",
                                 "type": "server_error", "param": None, "code": 503}})
    try:
        conn.setblocking(False)
        conn.send(REFUSAL.format(n=len(body), body=body).encode())
    except OSError:
        pass
    conn.close()


class Acceptor:
    """Accepts connections on the listening socket `sock` for `factory` (uvicorn's
    protocol) on `loop`, within `conns`' cap."""

    def __init__(self, sock: socket.socket, factory: Callable[[], Any], conns: Connections,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.sock, self.factory, self.conns, self.loop = sock, factory, conns, loop
        self.closed = False
        sock.setblocking(False)

    def start(self) -> None:
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._ready)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    def _ready(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:
                name = SHORT_OF.get(e.errno) or errno.errorcode.get(e.errno, str(e.errno))
                self.conns.counts["accept_errors"] += 1
                self.conns.once(name, f"[rollout] OpenAI endpoint: cannot accept a connection: "
                                      f"{os.strerror(e.errno) if e.errno else e} ({name}); "
                                      f"accepting pauses {PAUSE_S:g} s at a time while it "
                                      f"lasts (counted: rollout/openai_connections_"
                                      f"accept_errors)")
                self.loop.remove_reader(self.sock.fileno())
                self.loop.call_later(PAUSE_S, self.start)
                return
            if not self.conns.admit():
                _refuse(conn, self.conns.cap)
                continue
            conn.setblocking(False)
            self.loop.create_task(self._connect(conn))

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except OSError:
            self.conns.pending -= 1
            conn.close()


def header_deadline_protocol(timeout_s: float, conns: Connections):
    """uvicorn's h11 protocol with a deadline for each request's headers, registered in
    `conns`: uvicorn closes an idle keep-alive connection, but one that sends a partial
    request line or headers slowly (or nothing after connecting) would hold its
    descriptor for ever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        trusted = False  # a request of this connection authenticated

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # still no complete request line and headers

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            conns.made(self)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.scope is not None:  # a request's scope, before its app task runs
                self.scope.setdefault("extensions", {})[CONNECTION] = self

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers (uvicorn's keep-alive timer too)

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            conns.lost(self)
            super().connection_lost(exc)

    return HeaderDeadline
