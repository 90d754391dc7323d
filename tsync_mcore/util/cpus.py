"""CPU placement: the cores a side of the job runs on (launch.rollout_cpus / learner_cpus).

On a CPU machine the rollout and the learner compete for the same cores unless each gets
its own, the CPU analogue of rollout GPUs beside learner GPUs. The launcher passes a side's
cores to its processes in `TSYNC_CPUS` (with their thread counts); each process pins every
thread it has to them first thing (`pin_from_env`), before torch or vLLM start their
thread pools, so the threads they start later inherit the set.
"""

from __future__ import annotations

import os
import re

ENV = "TSYNC_CPUS"

_RANGE = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")


def parse(spec: str) -> list[int] | None:
    """'0-3,8' → [0, 1, 2, 3, 8]; '' → []; None if it is not such a list."""
    spec = spec.strip()
    if not spec:
        return []
    cpus: set[int] = set()
    for part in spec.split(","):
        m = _RANGE.fullmatch(part.strip())
        if m is None:
            return None
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > 4096:
            return None
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def pin(cpus: list[int]) -> None:
    """Every thread of this process onto `cpus` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def pin_from_env(who: str) -> list[int] | None:
    """Pin to `TSYNC_CPUS` when the launcher set it; one `error:` line and exit 2 when the
    cores are not this machine's (or not this process's to use). Returns the cores."""
    import sys

    spec = os.environ.get(ENV, "")
    cpus = parse(spec)
    if not spec or cpus is None:
        return None
    allowed = os.sched_getaffinity(0)
    missing = [c for c in cpus if c not in allowed]
    if missing:
        print(f"error: {who}: cores {missing} are not available here (this process may use "
              f"{_fmt(sorted(allowed))}; launch.rollout_cpus / launch.learner_cpus)",
              file=sys.stderr, flush=True)
        raise SystemExit(2)
    pin(cpus)
    print(f"{who}: on cores {_allowed_list()} ({os.environ.get('OMP_NUM_THREADS', '?')} "
          f"threads)", file=sys.stderr, flush=True)
    return cpus


def _allowed_list() -> str:
    """This process's cores as the kernel reports them (/proc/self/status)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return "?"


def _fmt(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))
