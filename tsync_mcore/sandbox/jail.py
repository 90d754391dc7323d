"""The jail: run untrusted programs (shell commands, Python code, scorer workers, agents)
in a limited subprocess (docs/guide/tools.md).

`run(argv)` runs a program to its end; `start(argv) -> Job` starts a long-lived one (pipes
for stdin/stdout on request; `Job.wait`, `Job.kill` of the whole jail). Each call gets:

* a directory of its own (HOME, TMPDIR and the working directory unless a kept `workdir`,
  a terminal episode's, is given), seeded from a template and `files`; `python`/`python3`
  on PATH are the interpreter the jailed uid can run (`interpreter`): this process's own
  where the jail has a mount namespace (view.py), else one runnable as it is. stdin, stdout
  and stderr are files in a root-private directory (or pipes, `start(pipes=True)`);
* an environment of PATH/HOME/TMPDIR/LANG and the caller's `env` only;
* its own session and process group, killed at the end (a wall timeout first);
* rlimits set by the launcher (launcher.py) just before exec: CPU, address space,
  processes, bytes per file, open files, no core;
* run as root: a uid of its own (`uid_base`) or `limits.user`, never root;
* a new network namespace (as root, else in a user namespace) whose `lo` is down, or up
  with `loopback` (127.0.0.1 inside only); `network="require"` makes its absence an error;
* per-call cgroups where writable (cgroups.py): pids (`pids.max`, every process killed at
  the end) and memory (memory_mb + disk_mb, tmpfs and memfd pages counted);
* run as root (`isolation`): mount, PID and IPC namespaces: every mount read-only; a
  private tmpfs on /tmp (/var/tmp and /dev/shm the same) bounded in bytes and inodes,
  holding the call's directory; an empty /run (and /var/run): no host Unix sockets;
  directories the uid cannot traverse covered, the interpreter's bound back read-only
  (view.py); a kept work directory and `binds` bound in writable, `expose` read-only,
  through descriptors opened before anything was covered; /proc of its own PID namespace,
  whose PID 1 is the launcher (its exit kills what is left);
* a seccomp filter (seccomp.py): no new namespaces, mounts, keyrings, ptrace, bpf, ...

Not a security boundary against a kernel exploit: the kernel is shared, and a program reads
what any user may read of the read-only system (docs/guide/tools.md lists what remains).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tsync_mcore.sandbox import cgroups, seccomp, view

UNSHARE = "/usr/bin/unshare"
UID_SPAN = 1 << 20  # per-run uids: uid_base + [0, UID_SPAN)
TRUNCATED = "\n[... output truncated: {n} more bytes]"

# Runs as the process group leader (in the new namespaces when there are): joins the pids
# cgroup; in a mount + PID namespace it builds the program's view of the filesystem (every
# mount read-only, a private size- and inode-bounded tmpfs on /tmp, /var/tmp and /dev/shm,
# the run's directories bound back writable through descriptors opened before, a /proc
# of the new PID namespace), stays as its PID 1 (reaping; its exit kills what is left)
# and forks the program; then sets the limits, drops privileges and execs the program.
class InRun(str):
    """An argument of `run`'s argv naming a file of the run's temporary directory."""


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no usable interpreter, user or network isolation)."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall time; CPU seconds: cpu_s, or this rounded up
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    nproc: int = 32  # processes: of this run (pids cgroup), else of the user (RLIMIT_NPROC)
    fsize_mb: int = 16  # bytes per written file (RLIMIT_FSIZE)
    nofile: int = 64  # open files
    user: str = "nobody"  # dropped to when running as root ("" keeps root: internal probes)
    python: str = ""  # "" : this interpreter, or the system python3 the user can run
    # "isolate": new network namespace where permitted, else on with a warning;
    # "require": SandboxError where not permitted; "host": the host's network
    network: str = "isolate"
    cpu_s: int = 0  # RLIMIT_CPU seconds (0: timeout_s rounded up)
    # RLIMIT_NPROC of the sandbox user when a pids cgroup bounds the run (the user's count
    # is shared by concurrent sandboxes: this is their sum's bound)
    nproc_user: int = 512
    max_output: int = 1 << 16  # bytes of stdout and of stderr kept (then a marker)
    # "isolate": mount, PID and IPC namespaces where permitted (root), else on with a
    # warning; "require": SandboxError where not permitted; "none": the host's view
    isolation: str = "isolate"
    disk_mb: int = 64  # the private /tmp (also /var/tmp, /dev/shm) and an episode_dir: bytes
    disk_inodes: int = 4096  # ... and files
    # run as root: each run's own uid (a kept work directory keeps the one it got), drawn
    # from [uid_base, uid_base + UID_SPAN); 0: every run as `user`
    uid_base: int = 0
    # host paths shown read-only inside (a project directory), and host directories bound in
    # writable (one holding a Unix socket); both at their own paths
    expose: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()  # host directories covered by an empty tmpfs (a run directory)
    loopback: bool = False  # the new network namespace's `lo` up (127.0.0.1 inside only)
    # a memory cgroup of its own (root): memory_mb + disk_mb of memory, tmpfs and memfd
    # pages included, swap too where the kernel accounts it; exceeding it is an OOM kill
    memory_cgroup: bool = True
    seccomp: bool = True  # the seccomp filter (tsync_mcore/sandbox/seccomp.py)

    def __post_init__(self) -> None:
        if self.network not in ("isolate", "require", "host"):
            raise ValueError(f"network must be 'isolate', 'require' or 'host', "
                             f"got {self.network!r}")
        if self.isolation not in ("isolate", "require", "none"):
            raise ValueError(f"isolation must be 'isolate', 'require' or 'none', "
                             f"got {self.isolation!r}")
        if self.uid_base and not 1000 <= self.uid_base <= (1 << 31) - UID_SPAN:
            raise ValueError(f"uid_base must be 0 or in [1000, 2^31 - {UID_SPAN}], "
                             f"got {self.uid_base}")
        for key in ("expose", "binds", "hide"):
            paths = getattr(self, key)
            if isinstance(paths, str) or not all(isinstance(p, str) and os.path.isabs(p)
                                                 and "\x00" not in p for p in paths):
                raise ValueError(f"{key} must be a tuple of absolute paths, got {paths!r}")
            object.__setattr__(self, key, tuple(paths))
        if self.loopback and self.network == "host":
            raise ValueError("loopback needs a network namespace of its own (network is 'host')")


@dataclass(frozen=True)
class Result:
    returncode: int | None  # None when killed at the wall timeout; -N: killed by signal N
    stdout: str
    stderr: str
    timed_out: bool  # the wall timeout killed it
    # which limit stopped it: "wall", "cpu", "fsize", "memory" (None: none did)
    limit: str | None
    wall_s: float
    truncated: bool  # stdout or stderr was cut at max_output
    network_isolated: bool
    pids_cgroup: bool  # a pids cgroup of its own bounded and cleaned up the run
    fs_isolated: bool = False  # mount, PID and IPC namespaces (read-only system, private /tmp)
    uid: int | None = None  # the uid the program ran as (None: this process's)
    memory_cgroup: bool = False  # a memory cgroup of its own bounded the run
    seccomp: bool = False  # the seccomp filter was installed

    @property
    def ok(self) -> bool:
        return self.returncode == 0


# --- probes (once per process) ------------------------------------------------------------

def _ids(user: str) -> tuple[int, int] | None:
    if os.geteuid() != 0 or not user:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise SandboxError(f"sandbox user {user!r} does not exist on this host") from None
    return pw.pw_uid, pw.pw_gid


def check_unprivileged(user: str, what: str) -> None:
    """SandboxError unless `user` names a user other than root: model-written code never
    runs as root ("" would keep this process's uid, root's when it is root)."""
    if not user or user == "root":
        raise SandboxError(f"{what}: the sandbox user {user!r} would run the model's code as "
                           f"root; name an unprivileged user (default 'nobody')")
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return  # unknown here: the jail says so when it runs
    if uid == 0:
        raise SandboxError(f"{what}: the sandbox user {user!r} has uid 0 (root)")


def _drop_kwargs(ids: tuple[int, int] | None) -> dict:
    if ids is None:
        return {}
    return dict(user=ids[0], group=ids[1], extra_groups=[])


_INTERPRETER: dict[tuple, str] = {}


def interpreter(limits: Limits) -> str:
    """A Python the jailed uid can run, probed once: the configured one; else, where the
    jail has a mount namespace, this process's own (the interpreter view, view.py, makes it
    runnable, its packages included); else this one or the system's python3 as they are (a
    root-only pyenv under /root is not runnable by nobody)."""
    ids = _ids(limits.user)
    viewed = (not limits.python and ids is not None and limits.isolation != "none"
              and not fs_isolation())
    key = (limits.python, ids, viewed)
    if key in _INTERPRETER:
        return _INTERPRETER[key]
    if viewed:
        r = run([sys.executable, "-I", "-c", "pass"], _exe=sys.executable,
                limits=Limits(user=limits.user, network="host", timeout_s=30,
                              memory_cgroup=False))
        if r.returncode == 0:
            _INTERPRETER[key] = sys.executable
            return sys.executable
        _warn_once(f"sandbox: this interpreter does not run in the jail "
                   f"({(r.stderr or r.stdout).strip()[-200:]!r}); trying others")
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
    raise SandboxError(f"no Python interpreter {who} can run for the sandbox (tried {tried}); "
                       f"set the sandbox python" + ("" if not ids else " or user"))


_NETNS: dict[bool, tuple[list[str], str]] = {}


def netns_prefix(as_root: bool | None = None) -> tuple[list[str], str]:
    """(argv prefix that starts a program in a new network namespace, or [] ; why not)."""
    as_root = os.geteuid() == 0 if as_root is None else as_root
    if as_root in _NETNS:
        return _NETNS[as_root]
    flags = ["--net"] if as_root else ["--user", "--net"]
    why = ""
    if not os.access(UNSHARE, os.X_OK):
        why = f"{UNSHARE} not found"
    else:
        try:
            r = subprocess.run([UNSHARE, *flags, "--", "/bin/sh", "-c", "exit 0"],
                               capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
            if r.returncode != 0:
                why = (f"unshare {' '.join(flags)} not permitted: "
                       f"{r.stderr.decode(errors='replace').strip()[:200]}")
        except (OSError, subprocess.SubprocessError) as e:
            why = f"unshare {' '.join(flags)} failed: {e}"
    _NETNS[as_root] = ([] if why else [UNSHARE, *flags, "--"], why)
    return _NETNS[as_root]


_FS_NS: list[str] = []
NS_FLAGS = ["--mount", "--pid", "--ipc", "--fork"]


def fs_isolation() -> str:
    """Why a run cannot get mount, PID and IPC namespaces here ("" : it can), probed once
    with a real run: only root can (a user namespace's root may not remount the host's
    mounts read-only with their locked flags)."""
    if not _FS_NS:
        why = ""
        if os.geteuid() != 0:
            why = "not running as root"
        elif not os.access(UNSHARE, os.X_OK):
            why = f"{UNSHARE} not found"
        else:
            try:
                view.clean_stale_episodes()  # the first sandbox of this process
                r = run(["/bin/sh", "-c", "touch /etc/.tsync-probe 2>/dev/null; ls /proc"],
                        limits=Limits(user="", network="host", isolation="require",
                                      memory_cgroup=False),
                        _probe=True, _exe="/bin/sh")
                pids = [x for x in r.stdout.split() if x.isdigit()]
                if r.returncode != 0 or os.path.exists("/etc/.tsync-probe") or len(pids) > 3:
                    why = f"the namespaces did not hold: {(r.stderr or r.stdout)[:200]!r}"
            except (OSError, SandboxError) as e:
                why = f"unshare {' '.join(NS_FLAGS)} failed: {e}"
        _FS_NS.append(why)
    return _FS_NS[0]


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        print(f"[sandbox] {msg}", file=sys.stderr, flush=True)


# --- running ------------------------------------------------------------------------------

def _chown_tree(path: str, ids: tuple[int, int]) -> None:
    """Give `path` and what is in it to the sandbox user, following no symlink: a kept
    work directory belongs to that user between calls, and a call could have put a link
    to any directory of root's in its place (root would then chown that one)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"sandbox: the work directory {path} is no longer a directory "
                           f"(a symlink or another file was put in its place); not run")
    os.chown(path, *ids, follow_symlinks=False)
    for root, dirs, files in os.walk(path):  # never into a symlinked directory
        for n in dirs + files:
            os.chown(os.path.join(root, n), *ids, follow_symlinks=False)


def _run_ids(workdir: str | None, base: int) -> tuple[int, int]:
    """This run's uid and gid: a kept work directory's, once it has one of the range (its
    episode's), else a fresh one. A run's files are its own: no other episode's program
    may write them, and RLIMIT_NPROC counts this run's processes alone."""
    if workdir:
        uid = os.lstat(workdir).st_uid
        if base <= uid < base + UID_SPAN:
            return uid, uid
    uid = base + secrets.randbelow(UID_SPAN)
    return uid, uid


def pids_cgroup_root() -> str | None:
    """A writable pids-cgroup directory the per-run cgroups are made in, or None."""
    return cgroups.pids_root()


def episode_dir(limits: Limits, prefix: str = "tsync-episode-") -> str:
    """A kept work directory for one episode (a terminal task's repo). Where the sandbox
    makes namespaces (root), a tmpfs of its own bounded by `disk_mb` / `disk_inodes`, so
    what the episode's calls write is bounded in bytes and files; else a plain temporary
    directory. Named for this process: one a killed process left is removed by the next
    process's first sandbox. `remove_episode_dir` undoes either."""
    bounded = limits.isolation != "none" and not fs_isolation()
    try:
        return view.episode_dir(bounded, limits.disk_mb, limits.disk_inodes, prefix)
    except OSError as e:
        raise SandboxError(f"sandbox: {e.strerror}") from None


def remove_episode_dir(path: str) -> None:
    """Remove an `episode_dir` (its tmpfs detached first, whatever it holds)."""
    view.remove_episode_dir(path)


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


def _read(path: str, limit: int) -> tuple[str, bool]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        text = f.read(limit).decode("utf-8", errors="replace")
    if size > limit:
        return text + TRUNCATED.format(n=size - limit), True
    return text, False


def _unrunnable(argv: Sequence[str], stdin: str, files: Mapping[str, str] | None) -> str | None:
    """Why text the model wrote cannot be handed to a program: a NUL byte in an argument
    (execve ends it there), or a lone surrogate anywhere (not encodable as UTF-8)."""
    for i, a in enumerate(argv):
        if isinstance(a, str) and "\x00" in a:
            return f"argument {i} of the command contains a NUL byte"
    texts = [("argument", a) for a in argv if isinstance(a, str)]
    texts += [("stdin", stdin)] + [(f"file {n!r}", t) for n, t in (files or {}).items()]
    for what, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"the {what} is not valid Unicode (a lone surrogate "
                    f"{text[e.start]!r} at character {e.start})")
    return None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_JAIL_ENV = ("PATH", "HOME", "TMPDIR")
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")


def _extra_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The caller's extra environment, names and values checked."""
    out = {}
    for k, v in (env or {}).items():
        if not isinstance(k, str) or not _ENV_NAME.match(k) or k in _JAIL_ENV:
            raise SandboxError(f"sandbox: environment variable {k!r} is not allowed (a name "
                               f"[A-Za-z_][A-Za-z0-9_]* other than {', '.join(_JAIL_ENV)})")
        if not isinstance(v, str) or "\x00" in v:
            raise SandboxError(f"sandbox: environment variable {k} must be a string without "
                               f"NUL bytes")
        out[k] = v
    return out


_SECCOMP: list[str] = []


def _seccomp_hex(limits: Limits) -> str:
    if not limits.seccomp:
        return ""
    why = seccomp.supported()
    if why:
        _warn_once(f"sandbox runs WITHOUT a seccomp filter: {why}")
        return ""
    if not _SECCOMP:
        _SECCOMP.append(seccomp.program().hex())
    return _SECCOMP[0]


class Job:
    """A program started in the jail (`start`). `wait` and `kill` may be called from any
    thread; the first `wait` to return ends the job (its cgroups and directories go), and
    every later one gets the same Result."""

    def __init__(self, proc: subprocess.Popen, cg: cgroups.CallCgroups, dirs: list[str],
                 status_r: int, info: dict) -> None:
        self._proc, self._cg, self._dirs, self._status_r = proc, cg, dirs, status_r
        self._info = info
        self._lock = threading.Lock()
        self._result: Result | None = None
        self._killed = False
        self.pid: int = proc.pid
        self.uid: int | None = info["uid"]  # the program's uid (None: this process's)
        self.stdin = proc.stdin  # binary pipes when started with pipes=True, else None
        self.stdout = proc.stdout

    def poll(self) -> int | None:
        """The launcher's exit status, or None while the program runs."""
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> Result:
        """Wait for the program (at most `timeout` seconds, then it is killed: the wall
        limit) and end the job."""
        with self._lock:
            if self._result is None:
                timed_out = False
                try:
                    self._proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                self._result = self._finish(timed_out)
            return self._result

    def kill(self) -> Result:
        """SIGKILL the whole jail (its process group, cgroups and PID namespace)."""
        self._killed = True
        if self._result is None and self._proc.returncode is None:  # the group's pid unreused
            _kill_group(self.pid, wait_s=0.0)
            for procs in self._cg.procs:
                _kill_listed(procs)
        return self.wait()

    def _finish(self, timed_out: bool) -> Result:
        info, proc = self._info, self._proc
        try:
            _kill_group(proc.pid, wait_s=0.0)
            proc.wait()  # the leader reaped: what is left of the group are children
            _kill_group(proc.pid)  # (until gone: killed ones stay until init reaps them)
        finally:
            oom = self._cg.memory and self._cg.oom_killed()
            self._cg.kill()
            status = b""
            if self._status_r >= 0:
                try:
                    status = os.read(self._status_r, 64)
                except BlockingIOError:  # nobody wrote it (killed)
                    pass
                os.close(self._status_r)
            if proc.stdin:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        wall = time.monotonic() - info["t0"]
        io, lim = self._dirs[0], info["limits"]
        out, t1 = ("", False) if info["pipes"] else _read(os.path.join(io, "stdout"),
                                                          lim.max_output)
        err, t2 = _read(os.path.join(io, "stderr"), lim.max_output)
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        rc = None if timed_out else proc.returncode
        if rc is not None and status.isdigit():  # PID 1's report (only root held that pipe)
            rc = os.waitstatus_to_exitcode(int(status))
        limit = ("wall" if timed_out else
                 "memory" if oom and rc is not None and rc < 0 else
                 "cpu" if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and not self._killed
                                                    and _cpu_killed(info["cpu"], wall)) else
                 "fsize" if rc == -signal.SIGXFSZ else None)
        return Result(rc, out, err, timed_out, limit, wall, t1 or t2, info["isolated"],
                      self._cg.pids, info["fs_ns"], info["uid"], self._cg.memory,
                      bool(info["seccomp"]))


def _kill_listed(procs: str) -> None:
    try:
        with open(procs) as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _prefix(limits: Limits, probe: bool) -> tuple[list[str], bool, bool]:
    """(argv prefix of the namespaces, network isolated, mount/PID/IPC namespaces)."""
    prefix: list[str] = []
    isolated = False
    if limits.network != "host":
        prefix, why = netns_prefix()
        isolated = bool(prefix)
        if not isolated:
            if limits.network == "require" or limits.loopback:
                raise SandboxError(f"sandbox: network isolation required but {why}")
            _warn_once(f"sandbox runs WITH network access: {why}")
    fs_ns = False
    if limits.isolation != "none":
        why = "" if probe else fs_isolation()
        fs_ns = not why
        if why:
            if limits.isolation == "require":
                raise SandboxError(f"sandbox: filesystem isolation required but {why}")
            _warn_once(f"sandbox runs WITHOUT mount/PID/IPC namespaces: {why}")
        elif not prefix:
            prefix = [UNSHARE, *NS_FLAGS, "--"]
        else:
            prefix = [*prefix[:-1], *NS_FLAGS, "--"]
    return prefix, isolated, fs_ns


def start(argv: Sequence[str], *, limits: Limits = Limits(), stdin: str = "",
          pipes: bool = False, workdir: str | None = None, template: str | None = None,
          files: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
          _probe: bool = False, _exe: str | None = None) -> Job:
    """Start `argv` in the jail; `Job.wait` ends it. The working directory is `workdir`
    (kept; made the run's uid's) or the call's own directory, seeded from `template`, with
    `files` (name -> text) in it; an `InRun` name in `argv` becomes a path in it. HOME and
    TMPDIR are that directory (on the call's bounded tmpfs where there are namespaces).
    `pipes`: stdin and stdout are pipes (`Job.stdin`, `Job.stdout`), else stdin is the text
    `stdin` and stdout is captured; stderr is captured. `env`: extra variables."""
    if not argv:
        raise SandboxError("sandbox: empty command")
    why = _unrunnable(argv, stdin, files)
    if why:
        raise SandboxError(f"sandbox: {why}")
    extra = _extra_env(env)
    ids = _ids(limits.user)
    prefix, isolated, fs_ns = _prefix(limits, _probe)
    exe = _exe or interpreter(limits)
    if ids is not None and limits.uid_base:
        ids = _run_ids(workdir, limits.uid_base)
    t0 = time.monotonic()
    # root-private (0700), named for this process (view.clean_stale_episodes)
    io = tempfile.mkdtemp(prefix=f"tsync-sandboxio-p{os.getpid()}-")
    stage = tempfile.mkdtemp(prefix=f"tsync-sandbox-p{os.getpid()}-")
    dirs = [io, stage]
    cg = cgroups.CallCgroups()
    try:
        rundir = os.path.join("/tmp", os.path.basename(stage)) if fs_ns else stage
        if template:
            shutil.copytree(template, stage, dirs_exist_ok=True, symlinks=True)
        # `python`/`python3` on PATH: the interpreter the jailed uid can run
        bindir = os.path.join(stage, ".sandbox-bin")
        os.mkdir(bindir)
        for alias in ("python", "python3"):
            os.symlink(exe, os.path.join(bindir, alias))
        for name, text in (files or {}).items():
            with open(os.path.join(stage, name), "w", encoding="utf-8") as f:
                f.write(text)
        if ids is not None and not fs_ns:
            _chown_tree(stage, ids)
        if ids is not None and workdir:
            _chown_tree(workdir, ids)
        cwd = os.path.abspath(workdir) if workdir else rundir
        binds = _binds(limits, workdir, ids, exe) if fs_ns else ([], [])
        cg = cgroups.make(limits.nproc, (limits.memory_mb + limits.disk_mb) << 20
                          if limits.memory_cgroup else None)
        cpu = int(limits.cpu_s) or max(1, int(limits.timeout_s + 0.999))
        args = dict(
            argv=[os.path.join(rundir, a) if isinstance(a, InRun) else a for a in argv],
            cpu=cpu, mem=limits.memory_mb << 20, fsize=limits.fsize_mb << 20,
            nofile=limits.nofile, nproc=limits.nproc_user if cg.pids else limits.nproc,
            cgroups=cg.procs, uid=ids[0] if ids else None, gid=ids[1] if ids else None,
            ns=fs_ns, loopback=limits.loopback and isolated, covers=binds[0],
            binds=binds[1], masks=_masks(*binds) if fs_ns else [],
            stage=stage if fs_ns else "", rundir=rundir, cwd=cwd,
            tmpfs=f"size={limits.disk_mb}m,nr_inodes={limits.disk_inodes},mode=1777",
            seccomp=_seccomp_hex(limits), status_fd=-1)
        penv = {**extra, "PATH": f"{os.path.join(rundir, '.sandbox-bin')}:/usr/local/bin:"
                                 f"/usr/bin:/bin",
                "HOME": rundir, "TMPDIR": rundir, "LANG": extra.get("LANG", "C.UTF-8"),
                "PYTHONDONTWRITEBYTECODE": "1"}
        with open(os.path.join(io, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        status_r = status_w = -1
        if fs_ns:  # PID 1 of the namespace reports the program's wait status here
            status_r, status_w = os.pipe()
            os.set_blocking(status_r, False)
            args["status_fd"] = status_w
        try:
            with open(os.path.join(io, "stdin"), "rb") as fin, \
                    open(os.path.join(io, "stdout"), "wb") as fout, \
                    open(os.path.join(io, "stderr"), "wb") as ferr:
                proc = subprocess.Popen(
                    [*prefix, sys.executable, "-I", "-S", LAUNCHER, json.dumps(args)],
                    cwd="/" if fs_ns else cwd, env=penv,
                    stdin=subprocess.PIPE if pipes else fin,
                    stdout=subprocess.PIPE if pipes else fout, stderr=ferr,
                    start_new_session=True, close_fds=True,
                    pass_fds=(status_w,) if fs_ns else ())
        except OSError as e:
            if status_r >= 0:
                os.close(status_r)
            raise SandboxError(f"sandbox: cannot start {argv[0]}: {e}") from None
        finally:
            if status_w >= 0:
                os.close(status_w)
    except BaseException:
        cg.kill()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        raise
    return Job(proc, cg, dirs, status_r, dict(
        t0=t0, limits=limits, pipes=pipes, cpu=cpu, isolated=isolated, fs_ns=fs_ns,
        uid=ids[0] if ids else None, seccomp=args["seccomp"]))


def _binds(limits: Limits, workdir: str | None, ids: tuple[int, int] | None,
           exe: str) -> tuple[list[str], list[tuple[str, str, bool]]]:
    """(tmpfs covers, (host path, path inside, writable) binds) of the call's mount
    namespace."""
    rw = [os.path.abspath(p) for p in ([workdir] if workdir else []) + list(limits.binds)]
    ro = [os.path.abspath(p) for p in limits.expose]
    interp = view.interpreter_paths() if exe == sys.executable else []
    covers = view.covers_for(interp + rw + ro, ids[0]) if ids else []
    covers += [os.path.abspath(p) for p in limits.hide if ids]
    binds = [(p, p, True) for p in rw] + [(p, p, False) for p in ro]
    binds += [(p, p, False) for p in interp if view.needs_bind(p, covers)]
    overlay = view.source_overlay() if interp else None
    if overlay:
        binds.append((*overlay, False))
    return covers, list(dict.fromkeys(binds))


def _masks(covers: list[str], binds: list[tuple[str, str, bool]]) -> list[str]:
    """Host Unix sockets the call would see: covered by an empty file inside."""
    return view.host_sockets([*covers, *(dst for _, dst, _ in binds)])


def run(argv: Sequence[str], *, limits: Limits = Limits(), stdin: str = "",
        workdir: str | None = None, template: str | None = None,
        files: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
        _probe: bool = False, _exe: str | None = None) -> Result:
    """Run `argv` in the jail to its end or `limits.timeout_s` (`start(...).wait`). Text the
    model wrote that cannot reach a program (a NUL in an argument, a lone surrogate) is the
    program's own error (exit status 2), not an exception."""
    why = _unrunnable(argv, stdin, files)
    if why:
        return Result(2, "", f"error: {why}\n", False, None, 0.0, False, False, False)
    return start(argv, limits=limits, stdin=stdin, workdir=workdir, template=template,
                 files=files, env=env, _probe=_probe, _exe=_exe).wait(limits.timeout_s)

def _cpu_killed(cpu_s: int, wall_s: float) -> bool:
    # SIGKILL without a wall timeout: the hard CPU limit (a program ignoring SIGXCPU) when
    # it ran at least that long; else something else killed it.
    return wall_s >= cpu_s + 1 - 0.05


# execve refuses one argument over 128 KiB (MAX_ARG_STRLEN): a longer command goes to bash
# as a script file instead
_ARG_MAX = 100_000


def run_shell(command: str, *, limits: Limits = Limits(), **kw) -> Result:
    """`command` run by bash (no profile or rc files): `bash -c command`, or, past what
    execve takes in one argument, `bash FILE` with the command in the call's directory."""
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    flags = [] if shell == "/bin/sh" else ["--noprofile", "--norc"]
    size = len(command.encode("utf-8", errors="replace"))
    if size <= _ARG_MAX:
        return run([shell, *flags, "-c", command], limits=limits, **kw)
    if size > limits.disk_mb << 20:
        return Result(2, "", f"error: the command is {size} bytes; the sandbox's disk "
                             f"({limits.disk_mb} MB) cannot hold it\n", False, None, 0.0,
                      False, False, False)
    files = dict(kw.pop("files", None) or {})
    files[".sandbox-command.sh"] = command
    return run([shell, *flags, InRun(".sandbox-command.sh")], limits=limits, files=files, **kw)


def run_python(code: str, *, limits: Limits = Limits(), stdin: str = "", **kw) -> Result:
    """`code` run as `python -I prog.py` (prog.py in the run's temporary directory)."""
    exe = interpreter(limits)
    files = dict(kw.pop("files", None) or {})
    files["prog.py"] = code
    return run([exe, "-I", InRun("prog.py")], limits=limits, stdin=stdin, files=files, **kw)


# Sandbox runs of the event loop's callers wait in these threads (blocked in wait(), not
# computing): enough for every episode of a large batch to run a tool at once, which
# asyncio's default pool (min(32, cores + 4) threads) is not.
_POOL_WORKERS = 64
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


async def in_thread(fn, *args, **kw):
    """`fn(*args, **kw)` in the sandbox thread pool: the event loop goes on meanwhile."""
    if not _POOL:
        _POOL.append(concurrent.futures.ThreadPoolExecutor(
            _POOL_WORKERS, thread_name_prefix="tsync-sandbox"))
    return await asyncio.get_running_loop().run_in_executor(
        _POOL[0], functools.partial(fn, *args, **kw))


async def arun(argv: Sequence[str], **kw) -> Result:
    """`run` in a worker thread: the event loop goes on while the program runs."""
    return await in_thread(run, argv, **kw)


async def arun_shell(command: str, **kw) -> Result:
    return await in_thread(run_shell, command, **kw)


async def arun_python(code: str, **kw) -> Result:
    return await in_thread(run_python, code, **kw)
