"""Run untrusted Python (a model's answer plus its tests) in a limited subprocess: the
code_tests reward's front to the general sandbox (tsync_mcore/sandbox/jail.py, docs/guide/tools.md).

Each program runs in a fresh temporary directory (its cwd, HOME and TMPDIR, removed
afterwards) as `python -I` (no PYTHON* variables, no user site) with an environment of
PATH/HOME/TMPDIR/LANG only — none of the trainer's variables (keys, tokens) —, in its own
session and process group, with stdin from a file and stdout/stderr to files. A small
launcher sets the limits and then execs the program:
RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space), RLIMIT_NPROC (processes of the user),
RLIMIT_FSIZE (bytes per written file; bounds the captured output too), RLIMIT_NOFILE,
RLIMIT_CORE = 0. The wall-time limit kills the whole process group (SIGKILL), and the
group is killed after a normal exit too, so background children do not outlive it.
Run as root, the program runs under a uid of its own (none of the host's; `uid_base`),
never root: RLIMIT_NPROC does not bind root, and root could read the run's secret and
checkpoints. Where Linux permits, it also runs in new network, mount, PID and IPC
namespaces (no network, the system read-only, a private bounded /tmp) and a pids cgroup of
its own; see tsync_mcore/sandbox/jail.py.

Not a security boundary against a determined attacker: no seccomp, a shared kernel (the
program reads world-readable files of the read-only system). docs/guide/data-and-rewards.md says what this does and does
not protect against.
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
