"""Run untrusted Python (a model's answer plus its tests) in the jail: the code_tests
reward's front to the general sandbox (tsync_mcore/sandbox/jail.py, docs/guide/tools.md).

Each program runs as `python -I prog.py` in a directory of its own (its cwd, HOME and
TMPDIR, on the call's bounded tmpfs) with an environment of PATH/HOME/TMPDIR/LANG only —
none of the trainer's variables —, under rlimits (CPU, address space, processes, bytes per
file, open files, no core), a seccomp filter, its own session and process group (killed at
the end), as a uid of its own (never root), and where Linux permits in new network, mount,
PID and IPC namespaces with per-call pids and memory cgroups. docs/guide/data-and-rewards.md
says what this does and does not protect against.
"""

from __future__ import annotations

from dataclasses import dataclass

from tsync_mcore.sandbox import jail as _sb
from tsync_mcore.sandbox.jail import SandboxError

__all__ = ["SandboxError", "SandboxLimits", "SandboxResult", "interpreter", "run_python"]


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall time; CPU time is limited to the next whole second
    memory_mb: int = 1024
    nproc: int = 32
    fsize_mb: int = 16
    nofile: int = 64
    user: str = "nobody"  # dropped to when running as root (never root, never "")
    python: str = ""  # "" : this interpreter, or the system python3 the user can run
    uid_base: int = 1 << 24  # run as root: each program under a uid of its own (0: `user`)

    def __post_init__(self) -> None:
        _sb.check_unprivileged(self.user, "reward sandbox")

    def general(self, max_output: int = 1 << 16) -> _sb.Limits:
        return _sb.Limits(timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                          nproc=self.nproc, fsize_mb=self.fsize_mb, nofile=self.nofile,
                          user=self.user, python=self.python, max_output=max_output,
                          uid_base=self.uid_base)


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed for time
    stdout: str
    stderr: str
    timed_out: bool


def interpreter(limits: SandboxLimits) -> str:
    """A Python the sandbox user can run, probed once: the configured one, this one, or the
    system's python3 (a root-only pyenv under /root is not runnable by nobody)."""
    return _sb.interpreter(limits.general())


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               max_output: int = 1 << 16) -> SandboxResult:
    """Run `code` under `limits`; returns its exit status and (truncated) output."""
    r = _sb.run_python(code, stdin=stdin, limits=limits.general(max_output))
    return SandboxResult(r.returncode, r.stdout, r.stderr, r.timed_out)
