"""The publication group's rendezvous store, authenticated: only a process that proves it
holds the group's key (derived from the run's channel secret) can read or write it.

c10d's TCPStore answers anyone who reaches its port: it lists the group's keys and lets
any local process set them, so an outsider could read the group's name and join as rank 0
before the learner (vLLM's StatelessProcessGroup, verl's and NeMo-RL's weight-update groups
all rendezvous over such a store). Here the rollout serves the store itself (`StoreServer`)
and every member talks to it through `GroupStore`, a `torch.distributed.Store` that gloo and
NCCL use like any other. Each connection opens with a mutual challenge-response over fresh
nonces (the channel handshake's construction, tsync_mcore.channel.handshake), and every
request and reply after it carries HMAC-SHA256(direction key, seq ‖ body), so a connection
cannot be spoken for by a process without the key. Nothing is encrypted.

    server → client  MAGIC, nonce_s
    client → server  MAGIC, nonce_c, HMAC(key, "client" ‖ nonce_s ‖ nonce_c)
    server → client  refused (0/1), HMAC(key, "server" ‖ nonce_s ‖ nonce_c)
    then frames      u32 length ‖ body ‖ tag; request body: op, args; reply: status, args
    (args: u32 length ‖ bytes each)

Imported inside vLLM's worker process: torch, the stdlib and the channel's handshake only.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import struct
import threading

import torch.distributed as dist

from tsync_mcore.channel.errors import ChannelError
from tsync_mcore.channel.handshake import NONCE_BYTES, TAG_BYTES, Mac, recv_exact

MAGIC = b"tsyncpst"
HANDSHAKE_S = 10.0  # a connection that has not proven the key by then is closed
MAX_CONNECTIONS = 256  # open at once; more are closed on accept
MAX_KEY = 1024  # bytes of a key
MAX_VALUE = 1 << 20  # bytes of a value (gloo's addresses, NCCL's unique id: < 1 KiB)
MAX_KEYS = 4096
MAX_FRAME = MAX_VALUE + 4 * MAX_KEY + 64
# requests
SET, GET, ADD, CHECK, WAIT, DELETE, NUM_KEYS, COMPARE_SET = range(8)
# replies
OK, TIMEOUT, ERROR = range(3)
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


class StoreError(RuntimeError):
    """The store refused a member, timed out, or a connection broke; the message says why."""


class StoreTimeout(StoreError):
    """What a member waited for did not appear within its timeout."""


def store_key(group_key: bytes) -> bytes:
    """The key members prove to the store: its own, derived from the group's."""
    return hmac.new(group_key, b"tsync-publish-store", hashlib.sha256).digest()


def _proof(key: bytes, side: bytes, nonces: bytes) -> bytes:
    return hmac.new(key, side + b"\0" + nonces, hashlib.sha256).digest()


def _pack(*args: bytes) -> bytes:
    return b"".join(_U32.pack(len(a)) + a for a in args)


def _unpack(body: bytes, at: int) -> list[bytes]:
    out = []
    while at < len(body):
        if at + 4 > len(body):
            raise StoreError("truncated argument")
        (n,) = _U32.unpack_from(body, at)
        if at + 4 + n > len(body):
            raise StoreError("truncated argument")
        out.append(body[at + 4:at + 4 + n])
        at += 4 + n
    return out


class _Conn:
    """One authenticated connection: framed, MAC'd messages each way, counted by seq."""

    def __init__(self, sock: socket.socket, key: bytes, nonces: bytes, side: bytes) -> None:
        self.sock = sock
        to_server = hmac.new(key, b"client->server\0" + nonces, hashlib.sha256).digest()
        to_client = hmac.new(key, b"server->client\0" + nonces, hashlib.sha256).digest()
        send, recv = (to_server, to_client) if side == b"client" else (to_client, to_server)
        self._send, self._recv = Mac(send), Mac(recv)
        self._sent = self._got = 0

    def send(self, body: bytes) -> None:
        tag = Mac.tag(self._send.begin(body), self._sent)
        self._sent += 1
        self.sock.sendall(_U32.pack(len(body)) + body + tag)

    def recv(self, what: str) -> bytes:
        (n,) = _U32.unpack(recv_exact(self.sock, 4, what))
        if n > MAX_FRAME:
            raise StoreError(f"{what}: frame of {n} bytes (at most {MAX_FRAME})")
        raw = recv_exact(self.sock, n + TAG_BYTES, what)
        body, tag = raw[:n], raw[n:]
        if not hmac.compare_digest(tag, Mac.tag(self._recv.begin(body), self._got)):
            raise StoreError(f"{what}: a message failed its MAC (tampered or injected)")
        self._got += 1
        return body


# --------------------------------------------------------------------------- the server


class StoreServer:
    """The store, served from this process at addr:`port` (0: a free one; read `.port`).
    `refused` counts connections that did not prove the key (outsiders, or a member run
    with another secret); `clear()` drops every key (the group formed: nothing needs them)."""

    def __init__(self, addr: str, port: int, key: bytes, timeout_s: float) -> None:
        self.key, self.timeout_s = key, timeout_s
        self.refused = 0
        self._data: dict[bytes, bytes] = {}
        self._cv = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._sock = socket.create_server((addr, port), backlog=128,
                                          family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="tsync-store-accept", daemon=True).start()

    def clear(self) -> None:
        with self._cv:
            self._data.clear()

    def close(self) -> None:
        self._closed = True
        for s in [self._sock, *list(self._conns)]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        with self._cv:
            self._cv.notify_all()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            if len(self._conns) >= MAX_CONNECTIONS:
                sock.close()
                continue
            self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="tsync-store-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            conn = self._handshake(sock)
            if conn is None:
                return
            sock.settimeout(None)  # members wait as long as their collectives allow
            while not self._closed:
                conn.send(self._answer(conn.recv("publication store request")))
        except (OSError, ChannelError, StoreError):
            pass  # the member left, or broke the protocol: its connection ends
        finally:
            self._conns.discard(sock)
            sock.close()

    def _handshake(self, sock: socket.socket) -> _Conn | None:
        sock.settimeout(HANDSHAKE_S)
        nonce_s = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + nonce_s)
        what = "publication store handshake"
        ok = recv_exact(sock, len(MAGIC), what) == MAGIC
        if ok:
            raw = recv_exact(sock, NONCE_BYTES + TAG_BYTES, what)
            nonces = nonce_s + raw[:NONCE_BYTES]
            ok = hmac.compare_digest(raw[NONCE_BYTES:], _proof(self.key, b"client", nonces))
        if not ok:
            self.refused += 1
            try:
                sock.sendall(b"\1" + bytes(TAG_BYTES))
            except OSError:
                pass
            return None
        sock.sendall(b"\0" + _proof(self.key, b"server", nonces))
        return _Conn(sock, self.key, nonces, b"server")

    def _answer(self, body: bytes) -> bytes:
        if not body:
            return bytes([ERROR]) + _pack(b"empty request")
        op, args = body[0], _unpack(body, 1)
        if any(len(a) > MAX_VALUE for a in args) or (args and len(args[0]) > MAX_KEY):
            return bytes([ERROR]) + _pack(b"key or value too long")
        cv, data = self._cv, self._data
        with cv:
            if op == SET and len(args) == 2:
                if args[0] not in data and len(data) >= MAX_KEYS:
                    return bytes([ERROR]) + _pack(b"store full")
                data[args[0]] = args[1]
                cv.notify_all()
                return bytes([OK])
            if op == ADD and len(args) == 2 and len(args[1]) == 8:
                try:
                    n = int(data.get(args[0], b"0") or b"0") + _I64.unpack(args[1])[0]
                except ValueError:
                    return bytes([ERROR]) + _pack(b"add to a key that holds no number")
                data[args[0]] = str(n).encode()
                cv.notify_all()
                return bytes([OK]) + _pack(_I64.pack(n))
            if op == COMPARE_SET and len(args) == 3:
                cur = data.get(args[0])
                if cur == args[1] or (cur is None and args[1] == b""):
                    data[args[0]] = cur = args[2]
                    cv.notify_all()
                return bytes([OK]) + _pack(cur if cur is not None else args[1])
            if op in (GET, WAIT) and len(args) >= 2 and len(args[0]) == 8:
                timeout = min(_I64.unpack(args[0])[0] / 1000, self.timeout_s)
                keys = args[1:]
                if not cv.wait_for(lambda: self._closed or all(k in data for k in keys),
                                   timeout=max(0.0, timeout)) or self._closed:
                    return bytes([TIMEOUT])
                return bytes([OK]) + (_pack(data[keys[0]]) if op == GET else b"")
            if op == CHECK:
                return bytes([OK]) + _pack(b"\1" if all(k in data for k in args) else b"\0")
            if op == DELETE and len(args) == 1:
                return bytes([OK]) + _pack(b"\1" if data.pop(args[0], None) is not None
                                           else b"\0")
            if op == NUM_KEYS:
                return bytes([OK]) + _pack(_I64.pack(len(data)))
        return bytes([ERROR]) + _pack(f"bad request (op {op})".encode())


# --------------------------------------------------------------------------- a member


_LIVE: set["GroupStore"] = set()  # c10d holds the C++ half; the Python half must live on


class GroupStore(dist.Store):
    """A member's connection to the `StoreServer` at addr:port, as a c10d Store (for
    ProcessGroupGloo/ProcessGroupNCCL, through a PrefixStore). StoreError when the server
    refuses `key` or cannot prove it holds it (not this run's store)."""

    def __init__(self, addr: str, port: int, key: bytes, timeout_s: float) -> None:
        super().__init__()
        self._where = f"publication store at {addr}:{port}"
        self._args = (addr, port, key, timeout_s)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        try:
            sock = socket.create_connection((addr, port), timeout=timeout_s)
        except OSError as e:
            raise StoreError(f"{self._where}: {e.strerror or e}") from None
        sock.settimeout(None)
        self._conn = self._handshake(sock, key)
        _LIVE.add(self)

    def _handshake(self, sock: socket.socket, key: bytes) -> _Conn:
        what = f"{self._where}: handshake"
        try:
            sock.settimeout(HANDSHAKE_S)
            head = recv_exact(sock, len(MAGIC) + NONCE_BYTES, what)
            if head[:len(MAGIC)] != MAGIC:
                raise StoreError(f"{what}: not a tsync publication store")
            nonce_c = os.urandom(NONCE_BYTES)
            nonces = head[len(MAGIC):] + nonce_c
            sock.sendall(MAGIC + nonce_c + _proof(key, b"client", nonces))
            verdict = recv_exact(sock, 1 + TAG_BYTES, what)
        except (OSError, ChannelError) as e:
            sock.close()
            raise StoreError(f"{what} failed: {e}") from None
        if verdict[0] != 0:
            sock.close()
            raise StoreError(f"{self._where} refused this member: it did not prove the "
                             f"run's secret (another run's channel secret?)")
        if not hmac.compare_digest(verdict[1:], _proof(key, b"server", nonces)):
            sock.close()
            raise StoreError(f"{self._where} did not prove the run's secret: not this "
                             f"run's store")
        sock.settimeout(None)
        return _Conn(sock, key, nonces, b"client")

    def _call(self, op: int, *args: bytes, what: str = "") -> list[bytes]:
        with self._lock:
            try:
                self._conn.send(bytes([op]) + _pack(*args))
                body = self._conn.recv(self._where)
            except (OSError, ChannelError) as e:
                raise StoreError(f"{self._where}: {e}") from None
        if body[:1] == bytes([TIMEOUT]):
            raise StoreTimeout(f"{self._where}: timed out waiting for {what}")
        if body[:1] != bytes([OK]):
            why = b"".join(_unpack(body, 1)).decode(errors="replace")
            raise StoreError(f"{self._where}: {why}")
        return _unpack(body, 1)

    def _ms(self, timeout) -> bytes:
        s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else \
            self._timeout_s if timeout is None else float(timeout)
        return _I64.pack(int(max(0.0, s) * 1000))

    # c10d's Store interface (keys arrive as str, values as bytes)
    def set(self, key, value) -> None:
        self._call(SET, _b(key), _b(value))

    def get(self, key) -> bytes:
        return self._call(GET, self._ms(None), _b(key), what=f"key {key}")[0]

    def add(self, key, value: int) -> int:
        return _I64.unpack(self._call(ADD, _b(key), _I64.pack(int(value)))[0])[0]

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call(COMPARE_SET, _b(key), _b(expected), _b(desired))[0]

    def check(self, keys) -> bool:
        return self._call(CHECK, *[_b(k) for k in keys])[0] == b"\1"

    def wait(self, keys, timeout=None) -> None:
        self._call(WAIT, self._ms(timeout), *[_b(k) for k in keys],
                   what=f"keys {', '.join(map(str, keys))}")

    def delete_key(self, key) -> bool:
        return self._call(DELETE, _b(key))[0] == b"\1"

    def num_keys(self) -> int:
        return _I64.unpack(self._call(NUM_KEYS)[0])[0]

    def clone(self) -> "GroupStore":
        return GroupStore(*self._args)

    def close(self) -> None:
        _LIVE.discard(self)
        try:
            self._conn.sock.close()
        except OSError:
            pass


def _b(x) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)

