"""Host cost of serving sources: aten ops dispatched, synchronising calls, host CPU time.

    with HostCounter() as hc, hc.watch(learner):
        ... begin / submit / close ...
    hc.units            # one Unit per unit a learner pass served (a source, or a group's close)
    hc.sections         # totals per section: "serve", "submit", "begin", "close", "outside"

A synchronising call is one that on CUDA makes the host wait for the device: reading a
device value (`.item()`, `float()`/`int()`/`bool()` of a tensor, `.tolist()`, `.numpy()`,
`.cpu()`), an op whose output size depends on device data (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`, `repeat_interleave` without `output_size`, `bincount`), an op
that answers a host bool (`equal`, `allclose`), a blocking copy across devices (device→host
always; host→device unless `non_blocking=True` from pinned memory — a plain
`torch.tensor(values, device=cuda)` copies from pageable memory and synchronises the
stream) and explicit `synchronize()` calls. They are counted on CPU too, where nothing
waits: the calls are the same, so the CPU count is the GPU one. On the CPU platform the
CPU stands in for the device, so every copy to an explicit device (`.to(device)`,
`.cpu()`, `torch.tensor(..., device=d)`) counts unless it is `non_blocking=True`; a tensor
made without a `device` argument is a host tensor.

Ops are seen through a TorchDispatchMode (below autograd: forward and backward ops alike,
composite ops as the ops they decompose into, e.g. `.item()` as `_local_scalar_dense`). Reads
that never reach the dispatcher on a CPU tensor (`tolist`, `numpy`, `cpu`, `to`, tensor
construction) are intercepted at the Python level while the counter is entered and restored
on exit; one such call is one synchronising call (the ops it dispatches are not counted
again as syncs). The dispatch mode costs Python time per op, of the order of the op itself
on small tensors (docs/measured/learner-cpu.md), so measure host time with `ops=False` (no
mode, the interceptions only) and count ops in a separate pass. Host time is the entering thread's CPU time (`time.thread_time_ns`),
charged to the innermost open section; on GPU the autograd engine runs backward in its own
threads, whose CPU time is not included. `cuda_sync_debug=True` (CUDA only) also counts
torch's own sync warnings (`torch.cuda.set_sync_debug_mode("warn")`) per section, as a
cross-check of the list here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostCounter", "Tally", "Unit", "SYNC_OPS"]

# aten ops (overload packets) that make the host wait for the device on CUDA.
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose",
    "nonzero", "argwhere", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "bincount", "_linalg_check_errors",
})
# Output size from device data only when a boolean mask indexes, or no output_size is given.
_MASK_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_COPIES = frozenset({"_to_copy", "copy_"})

# Calls that synchronise on CUDA once per process but run on every call on the CPU platform,
# which keeps on the CPU what megatron moves to the GPU on first use (RoPE's inv_freq):
# counted apart, as `exempt`, not as syncs. (what, file) as `sites` names them.
ONCE_ON_GPU = frozenset({
    ("Tensor.to", "megatron/core/models/common/embeddings/rotary_pos_embedding.py"),
})

_TORCH_DIR = os.path.dirname(torch.__file__)
# frames that only pass a call on: torch, this module, the CPU platform's CUDA redirect
_PASS_ON = (os.path.abspath(__file__),
            os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
                os.path.abspath(__file__)))), "platform", "cpu.py"))


@dataclass
class Tally:
    entries: int = 0
    ops: int = 0
    syncs: int = 0
    host_ns: int = 0
    cuda_syncs: int = 0  # torch's sync-debug warnings (cuda_sync_debug only)
    exempt: int = 0  # ONCE_ON_GPU calls
    sites: Counter = field(default_factory=Counter)  # "what at file:line" → syncs
    by_op: Counter = field(default_factory=Counter)  # aten op packet → calls

    def add(self, other: "Tally") -> None:
        self.entries += other.entries
        self.ops += other.ops
        self.syncs += other.syncs
        self.host_ns += other.host_ns
        self.cuda_syncs += other.cuda_syncs
        self.exempt += other.exempt
        self.sites.update(other.sites)
        self.by_op.update(other.by_op)


@dataclass
class Unit:
    """One unit of a learner pass (`Learner.serve_pass`): a served source (`key` its unit
    key) or a group's close."""

    key: str | None  # None: no source, the group's last work (its shared prompt, its sum)
    group_id: str
    tally: Tally


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: "HostCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        t = c._top
        t.ops += 1
        t.by_op[func.overloadpacket.__name__] += 1
        if not c._quiet and _op_syncs(func, args, kwargs):
            c._sync(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **kwargs)


def _op_syncs(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if name in _MASK_INDEXED:
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                   for t in idx or ())
    if name == "repeat_interleave":  # .Tensor(repeats) or .self_Tensor(x, repeats, ...)
        return kwargs.get("output_size") is None and (
            len(args) == 1 or isinstance(args[1], torch.Tensor))
    if name in _COPIES:
        if name == "_to_copy":
            if kwargs.get("device") is None:
                return False  # a cast on the same device
            src, dst = args[0].device, torch.device(kwargs["device"])
        else:
            dst, src = args[0].device, args[1].device
        non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2] is True)
        # a real crossing only: on the CPU platform the intercepted calls stand in for them
        return src.type != dst.type and (dst.type == "cpu" or not non_blocking)
    return False


def _copy_syncs(src: torch.device, dst: torch.device, non_blocking: bool) -> bool:
    """A copy from `src` to `dst` that makes the host wait on CUDA. On the CPU platform
    (no CUDA) the call stands for one to the device: any explicit blocking copy counts."""
    if not torch.cuda.is_available():
        return not non_blocking
    if src.type == dst.type:
        return False
    return dst.type == "cpu" or not non_blocking


def _to_target(args, kwargs) -> torch.device | None:
    """The device of a Tensor.to(...) call's arguments, or None (a dtype-only cast)."""
    d = kwargs.get("device")
    if d is None and args:
        a = args[0]
        if isinstance(a, (str, torch.device, int)):
            d = a
        elif isinstance(a, torch.Tensor):
            d = a.device
    return None if d is None else torch.device(d)


class HostCounter:
    """Context manager: counts ops, synchronising calls and host time per section.

    `ops`: count aten ops through a TorchDispatchMode (the synchronising ops are only
    seen then); False measures host time with nothing but the Python-level interceptions.
    """

    def __init__(self, ops: bool = True, cuda_sync_debug: bool = False):
        self.count_ops = ops
        self.cuda_sync_debug = cuda_sync_debug and torch.cuda.is_available()
        self.sections: dict[str, Tally] = {}
        self.units: list[Unit] = []
        self._stack: list[Tally] = []
        self._quiet = 0  # > 0 inside an intercepted call: its own ops are not syncs again
        self._patches: list[tuple[object, str, object, bool]] = []
        self._owner: int | None = None
        self._t = 0
        self._warned: list | None = None  # recorded warnings (cuda_sync_debug)
        self._seen = 0

    # --- sections -------------------------------------------------------------------------

    @property
    def _top(self) -> Tally:
        return self._stack[-1]

    def _charge(self) -> None:
        now = time.thread_time_ns()
        self._top.host_ns += now - self._t
        self._t = now
        if self._warned is not None and len(self._warned) > self._seen:
            self._top.cuda_syncs += sum(1 for w in self._warned[self._seen:]
                                        if "synchronizing" in str(w.message))
            self._seen = len(self._warned)

    @contextlib.contextmanager
    def section(self, name: str, tally: Tally | None = None):
        """Charge what happens inside to `tally` (default: a fresh one), then add it to
        `sections[name]`; nested sections take their own share out of the outer one."""
        t = tally or Tally()
        t.entries += 1
        self._charge()
        self._stack.append(t)
        try:
            yield t
        finally:
            self._charge()
            self._stack.pop()
            self.sections.setdefault(name, Tally()).add(t)

    def _sync(self, what: str) -> None:
        t, where = self._top, _caller()
        if (what, where.rsplit(":", 1)[0]) in ONCE_ON_GPU:
            t.exempt += 1
            return
        t.syncs += 1
        t.sites[f"{what} at {where}"] += 1

    # --- the learner ----------------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self, learner):
        """Sections for a Learner's entry points: each pass (`serve_pass`) is section
        "serve", with one Unit per unit it served; `submit` and `group_rewards` outside it
        are "submit"; `begin` and `close` outside it are the per-batch work."""
        names = {"begin": "begin", "close": "close", "submit": "submit",
                 "group_rewards": "submit"}
        for attr in [*names, "serve_pass"]:
            if attr in vars(learner):
                raise RuntimeError(f"learner.{attr} is wrapped already")
        for attr, sec in names.items():
            setattr(learner, attr, self._wrapped(getattr(learner, attr), sec))
        serve_pass = learner.serve_pass

        def _serve_pass(units):
            # why: a packed pass is one forward/backward; each of its sources is charged the
            # pass's tally for the per-unit maximum (the section sums count it once)
            tally = Tally()
            with self.section("serve", tally):
                serve_pass(units)
            self.units.extend(Unit(None if u.source is None else u.source.key, u.group_id,
                                   tally) for u in units)

        learner.serve_pass = _serve_pass
        wrapped = ["serve_pass"]
        try:
            yield self
        finally:
            for attr in [*names, *wrapped]:
                delattr(learner, attr)

    def _wrapped(self, fn, name: str):
        def call(*args, **kwargs):
            with self.section(name):
                return fn(*args, **kwargs)
        return call

    def per_source(self) -> dict:
        """Figures per served source (its pass and its `submit`), and per batch."""
        served = [u for u in self.units if u.key is not None]
        n = len(served)
        s, sub = self.sections.get("serve", Tally()), self.sections.get("submit", Tally())
        batch = Tally()
        for name in ("begin", "close"):
            batch.add(self.sections.get(name, Tally()))
        per = lambda x: x / n if n else 0.0  # noqa: E731
        ops = s.ops + sub.ops
        host_us = (s.host_ns + sub.host_ns) / 1e3
        return dict(sources=n, group_closes=len(self.units) - n,
                    ops=per(ops), syncs=per(s.syncs + sub.syncs), host_us=per(host_us),
                    max_source_syncs=max((u.tally.syncs for u in served), default=0),
                    batch_syncs=batch.syncs, batch_ops=batch.ops,
                    batch_host_us=batch.host_ns / 1e3)

    def sync_sites(self, sections: tuple[str, ...] = ("serve", "submit")) -> Counter:
        out = Counter()
        for name in sections:
            out.update(self.sections.get(name, Tally()).sites)
        return out

    # --- install / restore ----------------------------------------------------------------

    def __enter__(self) -> "HostCounter":
        if self._owner is not None:
            raise RuntimeError("HostCounter is not re-entrant")
        self._owner = threading.get_ident()
        self._stack = [Tally()]
        self._warned, self._seen = None, 0
        self._t = time.thread_time_ns()
        self._intercept()
        self._exit = contextlib.ExitStack()
        if self.cuda_sync_debug:
            self._warned = self._exit.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            prev = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            self._exit.callback(torch.cuda.set_sync_debug_mode, prev)
        if self.count_ops:
            self._exit.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._charge()
            self._exit.close()
        finally:
            self._restore()
            self.sections.setdefault("outside", Tally()).add(self._stack[0])
            self._owner = None

    def _patch(self, owner, name: str, make) -> None:
        own = name in vars(owner)
        orig = getattr(owner, name)
        self._patches.append((owner, name, orig, own))
        setattr(owner, name, make(orig))

    def _restore(self) -> None:
        while self._patches:
            owner, name, orig, own = self._patches.pop()
            if own:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)

    def _intercept(self) -> None:
        c = self

        def counted(what, syncs):
            def wrap(orig):
                def call(*args, **kwargs):
                    if c._quiet or threading.get_ident() != c._owner or not syncs(args, kwargs):
                        return orig(*args, **kwargs)
                    c._sync(what)
                    c._quiet += 1
                    try:
                        return orig(*args, **kwargs)
                    finally:
                        c._quiet -= 1
                return call
            return wrap

        always = lambda a, k: True  # noqa: E731
        for name in ("tolist", "numpy", "cpu"):
            self._patch(torch.Tensor, name, counted(f"Tensor.{name}", always))
        self._patch(torch.Tensor, "to", counted("Tensor.to", lambda a, k: (
            (d := _to_target(a[1:], k)) is not None
            and _copy_syncs(a[0].device, d, k.get("non_blocking", False)))))
        for name in ("tensor", "as_tensor"):
            self._patch(torch, name, counted(f"torch.{name}(device=)", lambda a, k: (
                k.get("device") is not None
                and _copy_syncs(torch.device("cpu"), torch.device(k["device"]), False))))
        # also on the CPU platform, which makes torch.cuda.synchronize a no-op
        self._patch(torch.cuda, "synchronize", counted("torch.cuda.synchronize", always))
        for cls in (torch.cuda.Stream, torch.cuda.Event):
            self._patch(cls, "synchronize", counted(f"{cls.__name__}.synchronize", always))


def _caller() -> str:
    """file:line of the first frame outside torch and this module (where a sync was asked)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or os.path.abspath(path) in _PASS_ON):
            return f"{_short(path)}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _short(path: str) -> str:
    for marker in ("/tsync_mcore/", "/megatron/", "/site-packages/"):
        i = path.find(marker)
        if i >= 0:
            return path[i + 1:]
    return os.path.basename(path)
