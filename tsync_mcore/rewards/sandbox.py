"""Run untrusted Python (a model's answer plus its tests) in a limited subprocess.

Each program runs in a fresh temporary directory (its cwd, HOME and TMPDIR, removed
afterwards) as `python -I` (no PYTHON* variables, no user site) with an environment of
PATH/HOME/TMPDIR/LANG only — none of the trainer's variables (keys, tokens) —, in its own
session and process group, with stdin from a file and stdout/stderr to files. A small
launcher sets the limits and then execs the program:
RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space), RLIMIT_NPROC (processes of the user),
RLIMIT_FSIZE (bytes per written file; bounds the captured output too), RLIMIT_NOFILE,
RLIMIT_CORE = 0. The wall-time limit kills the whole process group (SIGKILL), and the
group is killed after a normal exit too, so background children do not outlive it.
Run as root, the program runs as `reward.sandbox_user` (nobody): RLIMIT_NPROC does not
bind root, and root could read the run's secret and checkpoints.

Not a security boundary against a determined attacker: no namespaces, seccomp or network
isolation (the program can open sockets and read world-readable files), and a child that
calls setsid leaves the process group (it still dies at its CPU limit unless it sleeps).
docs/data-and-rewards.md says what this does and does not protect against.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

_LAUNCHER = """\
import os, resource, sys
cpu, mem, nproc, fsize, nofile = {cpu}, {mem}, {nproc}, {fsize}, {nofile}
for r, v in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem),
             (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize),
             (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(r, (v, v))
os.execv(sys.executable, [sys.executable, "-I", "prog.py"])
"""


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no usable interpreter or user)."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall time; CPU time is limited to the next whole second
    memory_mb: int = 1024
    nproc: int = 32
    fsize_mb: int = 16
    nofile: int = 64
    user: str = "nobody"  # dropped to when running as root ("" keeps root)
    python: str = ""  # "" : this interpreter, or the system python3 the user can run


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed for time
    stdout: str
    stderr: str
    timed_out: bool


def _ids(user: str) -> tuple[int, int] | None:
    if os.geteuid() != 0 or not user:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise SandboxError(f"reward.sandbox_user {user!r} does not exist on this host") from None
    return pw.pw_uid, pw.pw_gid


_INTERPRETER: dict[tuple, str] = {}


def interpreter(limits: SandboxLimits) -> str:
    """A Python the sandbox user can run, probed once: the configured one, this one, or the
    system's python3 (a root-only pyenv under /root is not runnable by nobody)."""
    ids = _ids(limits.user)
    key = (limits.python, ids)
    if key in _INTERPRETER:
        return _INTERPRETER[key]
    cands = [limits.python] if limits.python else [
        sys.executable, os.path.realpath(sys.executable),
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or ""]
    tried = []
    for exe in dict.fromkeys(c for c in cands if c):
        tried.append(exe)
        try:
            r = subprocess.run([exe, "-I", "-c", "pass"], env={"PATH": "/usr/bin:/bin"},
                               cwd="/", capture_output=True, timeout=30,
                               **_drop_kwargs(ids))
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0:
            _INTERPRETER[key] = exe
            return exe
    who = f"user {limits.user!r}" if ids else "this process"
    raise SandboxError(f"no Python interpreter {who} can run for code tests (tried {tried}); "
                       f"set reward.sandbox_python" + ("" if not ids else
                                                       " or reward.sandbox_user"))


def _drop_kwargs(ids: tuple[int, int] | None) -> dict:
    if ids is None:
        return {}
    return dict(user=ids[0], group=ids[1], extra_groups=[])


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               max_output: int = 1 << 16) -> SandboxResult:
    """Run `code` under `limits`; returns its exit status and (truncated) output."""
    ids = _ids(limits.user)
    exe = interpreter(limits)
    with tempfile.TemporaryDirectory(prefix="tsync-sandbox-") as d:
        with open(os.path.join(d, "prog.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(d, "launch.py"), "w") as f:
            f.write(_LAUNCHER.format(cpu=max(1, int(limits.timeout_s + 0.999)),
                                     mem=limits.memory_mb << 20, nproc=limits.nproc,
                                     fsize=limits.fsize_mb << 20, nofile=limits.nofile))
        with open(os.path.join(d, "stdin.txt"), "w", encoding="utf-8") as f:
            f.write(stdin)
        if ids is not None:
            for name in ("", "prog.py", "launch.py", "stdin.txt"):
                os.chown(os.path.join(d, name), *ids)
        env = {"PATH": "/usr/bin:/bin", "HOME": d, "TMPDIR": d, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
        out_path, err_path = os.path.join(d, "stdout.txt"), os.path.join(d, "stderr.txt")
        with open(os.path.join(d, "stdin.txt"), "rb") as fin, open(out_path, "wb") as fout, \
                open(err_path, "wb") as ferr:
            proc = subprocess.Popen([exe, "-I", "launch.py"], cwd=d, env=env, stdin=fin,
                                    stdout=fout, stderr=ferr, start_new_session=True,
                                    close_fds=True, **_drop_kwargs(ids))
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid, wait_s=0.0)
                proc.wait()  # the leader reaped: what is left of the group are its children
                _kill_group(proc.pid)
        return SandboxResult(None if timed_out else proc.returncode,
                             _read(out_path, max_output), _read(err_path, max_output),
                             timed_out)


def _kill_group(pgid: int, wait_s: float = 2.0) -> None:
    """SIGKILL the group and wait (briefly) until it is gone: its processes count against
    the sandbox user's RLIMIT_NPROC budget, which the next program shares."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")
