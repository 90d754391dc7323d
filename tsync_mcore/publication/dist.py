"""Publication over torch.distributed: θ_{k+1} broadcast in buckets from learner rank 0
straight into every rollout worker (docs/design/publication.md).

The group: learner rank 0 is group rank 0 (the broadcaster), each vLLM worker one more
rank. It is a standalone process group (gloo on CPU, NCCL on GPU) over a TCPStore that the
rollout hosts (receive.open_group), so neither side's default group (Megatron's, vLLM's) is touched. It
is made once, at the start of a run.

One publication, in order, every piece a broadcast from rank 0:
  control  int64[6]: MAGIC, version, header bytes, buckets, delta (0/1), full (0/1)
  header   uint8[...]: JSON {"bucket_bytes": B, "params": [[name, dtype, shape], ...]}
  without delta: each flat bucket, in order (its size follows from the header)
  with delta:  metas int64[2 × buckets]: (DENSE, numel) or (SPARSE, n) per bucket, then
               per bucket the flat bucket, or indices (int64[n]) + values (n elements of
               the bucket's dtype, as raw bits)
Buckets are cut from the header alone (`plan_buckets`), so both sides agree on them;
a bucket holds parameters of one dtype only. Everything received is checked (`Receiver`)
before it is loaded: the header (and so every size) before the first bucket, and a delta
publication whole. Nothing is pickled.

This module is imported inside vLLM's worker process: torch, json and the stdlib only.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import json
import math
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

MAGIC = 0x7473796E63  # "tsync"
DENSE, SPARSE = 0, 1
MAX_HEADER_BYTES = 16 << 20
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}
# element bits compared and sent as integers: exact for every value, NaN included
_BITS = {4: torch.int32, 2: torch.int16}


class PublishError(RuntimeError):
    """A publication over the group failed or carried bad data; the message says why."""


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str  # a DTYPES key
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    dtype: str
    params: tuple[int, ...]  # indices into the header's params
    offsets: tuple[int, ...]  # element offset of each param in the flat bucket
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


def params_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[Param]:
    return [Param(n, dtype_name(t.dtype, n), tuple(t.shape)) for n, t in named]


def dtype_name(dtype: torch.dtype, where: str) -> str:
    if dtype not in _NAMES:
        raise PublishError(f"{where}: dtype {dtype} cannot be published "
                           f"(one of {', '.join(DTYPES)})")
    return _NAMES[dtype]


def plan_buckets(params: list[Param], bucket_bytes: int) -> list[Bucket]:
    """Greedy, in header order: a bucket closes when the next param would overflow it or
    has another dtype; a param larger than a bucket gets one of its own."""
    out: list[Bucket] = []
    cur: list[int] = []
    offs: list[int] = []
    n = 0

    def close() -> None:
        nonlocal cur, offs, n
        if cur:
            out.append(Bucket(params[cur[0]].dtype, tuple(cur), tuple(offs), n))
        cur, offs, n = [], [], 0

    for i, p in enumerate(params):
        size = DTYPES[p.dtype].itemsize
        if cur and (params[cur[0]].dtype != p.dtype or (n + p.numel) * size > bucket_bytes):
            close()
        cur.append(i)
        offs.append(n)
        n += p.numel
    close()
    return out


def encode_header(params: list[Param], bucket_bytes: int) -> bytes:
    return json.dumps({"bucket_bytes": bucket_bytes,
                       "params": [[p.name, p.dtype, list(p.shape)] for p in params]},
                      separators=(",", ":")).encode()


def decode_header(raw: bytes, known: dict[str, tuple[int, ...]] | None) -> tuple[list[Param], int]:
    """The header's params and bucket size, checked: well-formed JSON of the right shape,
    unique names, known dtypes, shapes of non-negative ints, and (when `known` is given:
    the engine's checkpoint names → shapes) every name known with its shape."""
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise PublishError(f"publication header: not JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) != {"bucket_bytes", "params"}:
        raise PublishError("publication header: expected an object with bucket_bytes and "
                           "params only")
    bb, rows = doc["bucket_bytes"], doc["params"]
    if not isinstance(bb, int) or isinstance(bb, bool) or bb < 1:
        raise PublishError(f"publication header: bucket_bytes {bb!r} is not a positive int")
    if not isinstance(rows, list) or not rows:
        raise PublishError("publication header: params must be a non-empty list")
    params, seen = [], set()
    for i, row in enumerate(rows):
        ok = (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
              and row[1] in DTYPES and isinstance(row[2], list) and len(row[2]) <= 8
              and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40
                      for d in row[2]))
        if not ok:
            raise PublishError(f"publication header: params[{i}] is not "
                               f"[name, one of {'/'.join(DTYPES)}, [dims...]]: {str(row)[:120]}")
        p = Param(row[0], row[1], tuple(row[2]))
        if p.name in seen:
            raise PublishError(f"publication header: {p.name!r} appears twice")
        seen.add(p.name)
        if known is not None:
            if p.name not in known:
                raise PublishError(f"publication header: {p.name!r} is not a parameter of "
                                   f"this engine's model")
            if tuple(known[p.name]) != p.shape:
                raise PublishError(f"publication header: {p.name} has shape {list(p.shape)}, "
                                   f"the engine's model {list(known[p.name])}")
        params.append(p)
    return params, bb


def _xxh3():
    try:
        import xxhash  # installed with `datasets`; faster than zlib's CRC-32 (docs/measured/publication.md)
        return xxhash.xxh3_64_intdigest
    except ImportError:
        return None


_FAST_HASH = _xxh3()
CHECKSUM = "xxh3" if _FAST_HASH else "crc32"  # both sides name theirs: a mismatch shows


def bucket_checksum(flat: torch.Tensor) -> int:
    """XXH3-64 (else CRC-32) of a flat bucket's raw bytes (CPU tensors)."""
    b = flat.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return _FAST_HASH(b) if _FAST_HASH else zlib.crc32(b)


def fold_checksums(sums: list[int], nbytes: list[int]) -> str:
    """One digest of every bucket's (checksum, size), in bucket order, named by algorithm."""
    h = hashlib.blake2b(digest_size=16)
    for c, n in zip(sums, nbytes):
        h.update(c.to_bytes(8, "little") + n.to_bytes(8, "little"))
    return f"{CHECKSUM}:{h.hexdigest()}"


# --------------------------------------------------------------------------- the group


def host_store(addr: str, port: int, timeout_s: float):
    """The rendezvous TCPStore, served by the rollout driver; port 0: a free one
    (read `.port`)."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(addr, port, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 — the OS error names the problem
        raise PublishError(f"publication store at {addr}:{port}: {e}") from None


class Seal:
    """The rendezvous store emptied once the group has formed, and kept empty: nothing
    needs it after that, and it has no authentication, so any local process could list
    the group's token or park values in the host's memory. Every key is deleted now, and
    whatever is set later within `period_s` (`deleted` counts those)."""

    def __init__(self, store, period_s: float = 0.2) -> None:
        self.store, self.period_s = store, period_s
        self.deleted = 0
        self._stop = threading.Event()
        for k in store.list_keys():  # the group's own keys, before this returns
            store.delete_key(k)
        threading.Thread(target=self._sweep, name="tsync-store-seal", daemon=True).start()

    def _sweep(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                for k in self.store.list_keys():
                    self.store.delete_key(k)
                    self.deleted += 1
            except Exception:  # noqa: BLE001 — the store is going away with the run
                return

    def stop(self) -> None:
        self._stop.set()


def group_key(secret: bytes, token: str) -> bytes:
    """The key the members of publication group `token` prove they hold: derived from the
    run's channel secret, which only the learners and the rollout read."""
    return hmac.new(secret, b"tsync-publish-group\0" + token.encode(), hashlib.sha256).digest()


def join_group(addr: str, port: int, rank: int, world: int, *, token: str, timeout_s: float,
               backend: str = "gloo", ifname: str = "", key: bytes | None = None):
    """This process's member of the publication group (blocks until all `world` joined).
    `token` names the group in the store: only peers told it over the authenticated
    channel find it. `ifname`: the network interface the group binds to ("": default).
    `key` (`group_key`): every member then proves it holds the run's secret before any
    tensor moves; a member that cannot is named in a PublishError (the store itself is
    open to any local process, so the token alone proves nothing)."""
    from torch.distributed import PrefixStore, TCPStore

    if not 0 <= rank < world:
        raise PublishError(f"publication group: rank {rank} outside world {world}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = PrefixStore(f"tsync-publish/{token}",
                            TCPStore(addr, port, is_master=False, timeout=timeout))
        if backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # NCCL_SOCKET_IFNAME is read from the environment at communicator creation
            if ifname:
                import os

                os.environ["NCCL_SOCKET_IFNAME"] = ifname
            pg = ProcessGroupNCCL(store, rank, world, opts)
        elif backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(interface=ifname) if ifname
                             else ProcessGroupGloo.create_default_device()]
            pg = ProcessGroupGloo(store, rank, world, opts)
        else:
            raise PublishError(f"publication group: unknown backend {backend!r}")
        # A first collective: every member is connected once this returns.
        flag = torch.ones(1, dtype=torch.int64, device=_device(backend))
        _bcast(pg, flag)
        if key is not None:
            _authenticate(pg, rank, world, key, _device(backend))
    except PublishError:
        raise
    except Exception as e:  # noqa: BLE001 — c10d's message says what failed
        raise PublishError(f"publication group at {addr}:{port} (rank {rank} of {world}): "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return pg


def _authenticate(pg, rank: int, world: int, key: bytes, device: torch.device) -> None:
    """Each member sends a fresh nonce; then each sends HMAC(key, all nonces, its rank).
    A member whose MAC is wrong (it lacks the run's secret, or replays another session's)
    is named, and nothing more is sent or loaded on this side."""
    nonce = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8).to(device)
    nonces = _all_gather(pg, nonce, world)
    transcript = b"".join(bytes(t.cpu().tolist()) for t in nonces)

    def mac(r: int) -> bytes:
        return hmac.new(key, transcript + r.to_bytes(4, "big"), hashlib.sha256).digest()

    mine = torch.frombuffer(bytearray(mac(rank)), dtype=torch.uint8).to(device)
    macs = _all_gather(pg, mine, world)
    bad = [r for r in range(world) if r != rank
           and not hmac.compare_digest(bytes(macs[r].cpu().tolist()), mac(r))]
    if bad:
        raise PublishError(f"publication group: rank(s) {bad} did not prove the run's "
                           f"secret (a process outside the run joined the group?); "
                           f"nothing is loaded")


def _all_gather(pg, t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    try:
        pg.allgather([out], [t]).wait()
    except Exception as e:  # noqa: BLE001 — a peer gone or the group's timeout
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PublishError(f"publication group handshake failed: {msg}") from None
    return out


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """A flat bucket as its raw bits."""
    return flat.view(_BITS[flat.element_size()])


def _bcast(pg, t: torch.Tensor) -> None:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    try:
        # as bytes: gloo has no int16/bfloat16, and bits are what must arrive
        pg.broadcast([t.reshape(-1).view(torch.uint8)], opts).wait()
    except Exception as e:  # noqa: BLE001 — a peer gone or the group's timeout
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PublishError(f"publication broadcast failed: {msg}") from None


# --------------------------------------------------------------------------- sending


@dataclass
class SendStats:
    bytes: int = 0  # everything broadcast: control, header, metas, payloads
    buckets: int = 0
    sparse_buckets: int = 0
    full: bool = True  # no bucket was sent as a delta
    changed: int = 0  # elements that differ from the previous publication (delta only)
    elements: int = 0
    checksum: str = ""  # of the published weights (delta only)


@dataclass
class Sender:
    """Learner rank 0's side. `publish` takes the HF-named tensors in header order (an
    iterator: a TP learner gathers them one by one) and broadcasts them bucket by bucket.
    With `delta`, the flat buckets of the last publication stay in host memory to diff
    against; `force_full` (set after a replica's checksum mismatched) sends all of them."""

    pg: object
    params: list[Param]
    bucket_bytes: int
    backend: str = "gloo"
    delta: bool = False
    dense_frac: float = 0.25
    force_full: bool = True  # the first publication is always whole
    base: list[torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.header = encode_header(self.params, self.bucket_bytes)
        self.buckets = plan_buckets(self.params, self.bucket_bytes)
        self.device = _device(self.backend)
        # Buffers packed into, reused across publications (fresh ones cost a page fault
        # per 4 KiB): one bucket's worth without delta (sent before the next is packed),
        # with delta the buckets of the publication before the last (base swaps with it).
        self._spare: list[torch.Tensor] | None = None

    def publish(self, version: int, named: Iterable[tuple[str, torch.Tensor]]) -> SendStats:
        full = not self.delta or self.force_full or self.base is None
        st = SendStats(full=full)
        control = torch.tensor([MAGIC, version, len(self.header), len(self.buckets),
                                int(self.delta), int(full)], dtype=torch.int64)
        self._send(control, st)
        self._send(torch.frombuffer(bytearray(self.header), dtype=torch.uint8), st)
        flats = self._flats(iter(named), self._buffers())
        if not self.delta:  # streamed: each bucket goes as soon as it is gathered
            for flat in flats:
                st.buckets += 1
                st.elements += flat.numel()
                st.changed += flat.numel()
                self._send(_bits(flat), st)
            return st
        # delta: every bucket is encoded before any is sent, so that the metas go first
        # and a replica checks all of them before it loads anything
        new = list(flats)
        blocks = [self._encode(b, flat, full, st) for b, flat in enumerate(new)]
        self._send(torch.tensor([m for meta, _ in blocks for m in meta], dtype=torch.int64), st)
        for _, payload in blocks:
            for t in payload:
                self._send(t, st)
        self.base, self._spare, self.force_full = new, self.base, False
        st.checksum = fold_checksums([bucket_checksum(f) for f in new],
                                     [b.nbytes for b in self.buckets])
        st.full = st.sparse_buckets == 0
        return st

    def _buffers(self) -> list[torch.Tensor]:
        """A flat CPU buffer per bucket to pack into (views of one buffer without delta)."""
        if not self.delta:
            if self._spare is None:
                self._spare = [torch.empty(max(b.nbytes for b in self.buckets), dtype=torch.uint8)]
            one = self._spare[0]
            return [one[:b.nbytes].view(DTYPES[b.dtype]) for b in self.buckets]
        if self._spare is None:
            return [torch.empty(b.numel, dtype=DTYPES[b.dtype]) for b in self.buckets]
        return self._spare

    def _flats(self, it: Iterator[tuple[str, torch.Tensor]], buffers: list[torch.Tensor]
               ) -> Iterator[torch.Tensor]:
        """The flat buckets, in order, filled from `it` (checked against the header)."""
        for bucket, flat in zip(self.buckets, buffers):
            for i, off in zip(bucket.params, bucket.offsets):
                p = self.params[i]
                try:
                    name, t = next(it)
                except StopIteration:
                    raise PublishError(f"publish: the model ended before {p.name}") from None
                if (name != p.name or tuple(t.shape) != p.shape
                        or dtype_name(t.dtype, name) != p.dtype):
                    raise PublishError(f"publish: got {name} {list(t.shape)} {t.dtype}, the "
                                       f"header says {p.name} {list(p.shape)} {p.dtype}")
                flat[off:off + p.numel].copy_(t.reshape(-1))
            yield flat

    def _encode(self, b: int, flat: torch.Tensor, full: bool, st: SendStats
                ) -> tuple[tuple[int, int], list[torch.Tensor]]:
        """(meta, payload) of bucket b: whole, or the changed elements' indices and bits."""
        st.buckets += 1
        st.elements += flat.numel()
        if full:
            st.changed += flat.numel()
            return (DENSE, flat.numel()), [_bits(flat)]
        bits = _BITS[flat.element_size()]
        idx = (flat.view(bits) != self.base[b].view(bits)).nonzero().flatten()
        st.changed += idx.numel()
        if idx.numel() > self.dense_frac * flat.numel():
            return (DENSE, flat.numel()), [_bits(flat)]
        st.sparse_buckets += 1
        payload = [idx.to(torch.int64), flat.view(bits)[idx].contiguous()] if idx.numel() else []
        return (SPARSE, idx.numel()), payload

    def _send(self, t: torch.Tensor, st: SendStats) -> None:
        st.bytes += t.numel() * t.element_size()
        _bcast(self.pg, t.to(self.device) if self.device.type != "cpu" else t)


# --------------------------------------------------------------------------- receiving


@dataclass
class Received:
    version: int
    bytes: int = 0
    checksum: str = ""  # of the weights now held (delta only)


class Receiver:
    """A rollout worker's side. `begin` reads and checks the control block and the header
    (nothing is loaded yet); `tensors` then yields (HF name, tensor) for the worker's
    `reload_weights`: bucket by bucket as they arrive, or with delta, once the whole
    publication arrived and checked (block sizes, indices), so bad input never reaches the
    model. With delta the flat buckets of the weights loaded last stay in host memory and
    a sparse bucket is applied to its base bucket (delta's price: one HF-named copy of the
    model on the rollout host)."""

    def __init__(self, pg, known: dict[str, tuple[int, ...]], backend: str = "gloo") -> None:
        self.pg = pg
        self.known = known
        self.device = _device(backend)
        self.base: list[torch.Tensor] | None = None
        self.base_header: bytes | None = None

    def begin(self, version: int, n_buckets: int, delta: bool
              ) -> tuple[list[Param], list[Bucket], Received]:
        got = Received(version)
        control = self._recv(torch.empty(6, dtype=torch.int64), got)
        magic, v, hlen, nb, d, full = (int(x) for x in control.cpu())
        if magic != MAGIC:
            raise PublishError(f"publication of θ_{version}: bad control block (magic {magic:#x})")
        if v != version or nb != n_buckets or bool(d) != delta:
            raise PublishError(f"publication: the group carries θ_{v} ({nb} buckets, "
                               f"delta={bool(d)}), the notice θ_{version} ({n_buckets} "
                               f"buckets, delta={delta})")
        if not 0 < hlen <= MAX_HEADER_BYTES:
            raise PublishError(f"publication of θ_{version}: header of {hlen} bytes "
                               f"(1..{MAX_HEADER_BYTES})")
        raw = bytes(self._recv(torch.empty(hlen, dtype=torch.uint8), got).cpu().numpy())
        params, bb = decode_header(raw, self.known)
        buckets = plan_buckets(params, bb)
        if len(buckets) != nb:
            raise PublishError(f"publication of θ_{version}: header makes {len(buckets)} "
                               f"buckets, control says {nb}")
        self._raw, self._ready = raw, None
        if delta:  # everything arrives and is checked before any of it is loaded
            has_base = self.base is not None and raw == self.base_header
            self._ready = self._receive_delta(buckets, bool(full), has_base, got)
        return params, buckets, got

    def tensors(self, params: list[Param], buckets: list[Bucket], got: Received
                ) -> Iterator[tuple[str, torch.Tensor]]:
        flats = self._ready if self._ready is not None else (
            self._recv_flat(b, got) for b in buckets)
        for bucket, flat in zip(buckets, flats):
            for i, off in zip(bucket.params, bucket.offsets):
                p = params[i]
                yield p.name, flat[off:off + p.numel].view(p.shape)
        if self._ready is not None:
            self.base, self.base_header = self._ready, self._raw
            got.checksum = fold_checksums([bucket_checksum(f) for f in self._ready],
                                          [b.nbytes for b in buckets])

    def _receive_delta(self, buckets: list[Bucket], full: bool, has_base: bool,
                       got: Received) -> list[torch.Tensor]:
        metas = self._recv(torch.empty(2 * len(buckets), dtype=torch.int64), got).cpu()
        metas = [(int(metas[2 * b]), int(metas[2 * b + 1])) for b in range(len(buckets))]
        for b, ((kind, n), bucket) in enumerate(zip(metas, buckets)):
            if kind == DENSE and n == bucket.numel:
                continue
            if kind == SPARSE and not full and has_base and 0 <= n <= bucket.numel:
                continue
            why = ("a sparse block in a full publication" if kind == SPARSE and full else
                   "a sparse block, but this replica holds no base with the same header"
                   if kind == SPARSE and not has_base else
                   f"kind {kind} with {n} elements, the header says {bucket.numel}")
            raise PublishError(f"publication bucket {b}: {why}")
        # Sparse blocks are applied to the base in place; until the publication is whole
        # the replica holds no base (a failure stops the run, and no delta applies to a
        # half-updated base).
        base, self.base, self.base_header = self.base, None, None
        out = []
        for b, ((kind, n), bucket) in enumerate(zip(metas, buckets)):
            dtype = DTYPES[bucket.dtype]
            if kind == DENSE:
                out.append(self._recv_flat(bucket, got).cpu())
                continue
            flat = base[b]
            if n:
                bits = _BITS[dtype.itemsize]
                idx = self._recv(torch.empty(n, dtype=torch.int64, device=self.device), got).cpu()
                vals = self._recv(torch.empty(n, dtype=bits, device=self.device), got).cpu()
                if int(idx.min()) < 0 or int(idx.max()) >= bucket.numel:
                    raise PublishError(f"publication bucket {b}: delta index outside "
                                       f"0..{bucket.numel - 1}")
                flat.view(bits)[idx] = vals
            out.append(flat)
        return out

    def _recv_flat(self, bucket: Bucket, got: Received) -> torch.Tensor:
        dtype = DTYPES[bucket.dtype]
        bits = torch.empty(bucket.numel, dtype=_BITS[dtype.itemsize], device=self.device)
        return self._recv(bits, got).view(dtype)

    def _recv(self, t: torch.Tensor, got: Received) -> torch.Tensor:
        _bcast(self.pg, t)
        got.bytes += t.numel() * t.element_size()
        return t
