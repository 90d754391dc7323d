"""Per-call cgroups of the jail: a pids cgroup (`pids.max`: the call's processes, setsid
escapees included, all killed at the end) and a memory cgroup whose limit counts what the
call holds in memory — its processes, and the pages of its tmpfs and memfds, which an
address-space rlimit does not see. cgroup v1 (`/sys/fs/cgroup/{pids,memory}`) or v2 (one
directory with both controllers); probed once per process, used where writable (root).
Named for their process: the first probe of a process removes those a killed one left."""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field

PARENT = "tsync-sandbox"
_ROOTS: dict[str, str | None] = {}


def _probe(kind: str, bases: tuple[str, ...], limit_file: str, value: str) -> str | None:
    if os.geteuid() != 0:
        return None
    for base in bases:
        parent = os.path.join(base, PARENT)
        probe = os.path.join(parent, f"probe-{os.getpid()}")
        try:
            os.makedirs(parent, exist_ok=True)
            if base == "/sys/fs/cgroup" or base.endswith("unified"):  # v2: enable below
                try:
                    with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                        f.write(f"+{kind}")
                except OSError:
                    pass
            os.makedirs(probe, exist_ok=True)
            with open(os.path.join(probe, limit_file), "w") as f:
                f.write(value)
            os.rmdir(probe)
            return parent
        except OSError:
            try:
                os.rmdir(probe)
            except OSError:
                pass
    return None


_STALE = re.compile(r"^run-p(\d+)-")


def _clean_stale(parent: str) -> None:
    """Kill and remove the call cgroups of processes that are gone (SIGKILLed callers)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for n in names:
        m = _STALE.match(n)
        if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
            _kill_one(os.path.join(parent, n), wait_s=1.0)


def pids_root() -> str | None:
    """A writable pids-cgroup directory to make per-call cgroups in, or None."""
    if "pids" not in _ROOTS:
        _ROOTS["pids"] = _probe("pids", ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified",
                                         "/sys/fs/cgroup"), "pids.max", "8")
        if _ROOTS["pids"]:
            _clean_stale(_ROOTS["pids"])
    return _ROOTS["pids"]


def memory_root() -> str | None:
    """A writable memory-cgroup directory (v1 `memory`, or v2 with the memory controller)."""
    if "memory" not in _ROOTS:
        v1 = _probe("memory", ("/sys/fs/cgroup/memory",), "memory.limit_in_bytes",
                    str(64 << 20))
        _ROOTS["memory"] = v1 or _probe("memory", ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"),
                                        "memory.max", str(64 << 20))
        if _ROOTS["memory"]:
            _clean_stale(_ROOTS["memory"])
    return _ROOTS["memory"]


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


@dataclass
class CallCgroups:
    """One call's cgroup directories; the launcher writes its pid to each `procs` file."""

    dirs: list[str] = field(default_factory=list)
    pids: bool = False
    memory: bool = False

    @property
    def procs(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        """The memory limit killed a process of the call."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):  # v2, v1
                try:
                    with open(os.path.join(d, name)) as f:
                        for line in f:
                            k, _, v = line.partition(" ")
                            if k == "oom_kill" and int(v) > 0:
                                return True
                except (OSError, ValueError):
                    pass
        return False

    def kill(self, wait_s: float = 5.0) -> None:
        """SIGKILL every process of the call's cgroups, then remove them."""
        for d in self.dirs:
            _kill_one(d, wait_s)
        self.dirs = []


def make(nproc: int, memory_bytes: int | None) -> CallCgroups:
    """This call's cgroups: pids.max = `nproc`; a memory limit of `memory_bytes` (and the
    same memory+swap limit where the kernel accounts swap) unless None."""
    cg = CallCgroups()
    proot = pids_root()
    if proot:
        d = tempfile.mkdtemp(prefix=f"run-p{os.getpid()}-", dir=proot)
        if _write(os.path.join(d, "pids.max"), str(nproc)):
            cg.dirs.append(d)
            cg.pids = True
        else:
            os.rmdir(d)
    mroot = memory_root() if memory_bytes else None
    if mroot and mroot == proot and cg.pids:  # v2: one directory holds both controllers
        d = cg.dirs[0]
        cg.memory = _write(os.path.join(d, "memory.max"), str(memory_bytes)) and \
            (not os.path.exists(os.path.join(d, "memory.swap.max")) or
             _write(os.path.join(d, "memory.swap.max"), "0"))
    elif mroot:
        d = tempfile.mkdtemp(prefix=f"run-p{os.getpid()}-", dir=mroot)
        ok = _write(os.path.join(d, "memory.limit_in_bytes"), str(memory_bytes))
        memsw = os.path.join(d, "memory.memsw.limit_in_bytes")
        if ok and os.path.exists(memsw):
            ok = _write(memsw, str(memory_bytes))
        if ok:
            cg.dirs.append(d)
            cg.memory = True
        else:
            os.rmdir(d)
    return cg


def _kill_one(cg: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(os.path.join(cg, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            print(f"[sandbox] cgroup {cg} still has processes after {wait_s}s", flush=True)
            return
        time.sleep(0.01)
    for _ in range(100):
        try:
            os.rmdir(cg)
            return
        except OSError:
            time.sleep(0.01)
