"""Run untrusted shell commands or Python code in a limited subprocess (docs/guide/tools.md).

Each run gets:

* a working directory: a fresh temporary one (removed afterwards), optionally seeded with
  a copy of a template directory, or a caller's persistent one (a terminal episode's repo);
  it is also HOME and TMPDIR. `python` and `python3` on PATH are the interpreter the
  sandbox user can run (`interpreter`). stdin/stdout/stderr are files in a second, root-private
  temporary directory (the program only holds their descriptors, so it cannot swap them
  for links to files it may not read);
* an environment of PATH/HOME/TMPDIR/LANG only (none of the trainer's variables);
* its own session and process group; a wall timeout SIGKILLs the group, and the group is
  killed after a normal exit too, so background children do not outlive the run;
* rlimits set by a launcher just before it execs the program: RLIMIT_CPU (soft: CPU
  seconds, SIGXCPU; hard one second later, SIGKILL), RLIMIT_AS (address space),
  RLIMIT_NPROC, RLIMIT_FSIZE (bytes per written file: SIGXFSZ; bounds the captured output
  too), RLIMIT_NOFILE, RLIMIT_CORE = 0;
* run as root: the program runs as `limits.user` (nobody) — RLIMIT_NPROC does not bind
  root, and root could read the run's secret and checkpoints;
* no network where Linux permits: the launcher starts in a new network namespace
  (`unshare --net`; as root before dropping privileges, otherwise in a new user
  namespace) whose only interface is loopback, down. Where that is not permitted the
  run goes on without it and says so (`Result.network_isolated` False, one warning);
  `network="require"` makes it a SandboxError instead;
* a pids cgroup of its own where one is writable (cgroup v1 `pids` or v2 with the pids
  controller): `pids.max` = `limits.nproc` for this run alone, and every process in it
  (setsid escapees included) is killed at the end. Without it, the process bound is
  RLIMIT_NPROC alone, which counts all processes of the sandbox user — shared by every
  concurrent sandbox (and anything else running as nobody).

* run as root (`isolation`, probed once): mount, PID and IPC namespaces. The program sees
  every mount read-only, a private tmpfs on /tmp (/var/tmp and /dev/shm are the same one)
  bounded in bytes and inodes, and on it only its own run directory and work directory,
  bound back writable through descriptors opened before /tmp was covered (so no path the
  program could have swapped is followed); /proc shows its own PID namespace, whose PID 1
  is the launcher: when it exits, the kernel kills whatever is left. With `uid_base` every
  run has a uid of its own (a kept work directory keeps its episode's).

Not a security boundary against a determined attacker: no seccomp, the kernel is shared,
and a program reads what any user may read of the (read-only) system.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

UNSHARE = "/usr/bin/unshare"
UID_SPAN = 1 << 20  # per-run uids: uid_base + [0, UID_SPAN)
TRUNCATED = "\n[... output truncated: {n} more bytes]"

# Runs as the process group leader (in the new namespaces when there are): joins the pids
# cgroup; in a mount + PID namespace it builds the program's view of the filesystem (every
# mount read-only, a private size- and inode-bounded tmpfs on /tmp, /var/tmp and /dev/shm,
# the run's directories bound back writable through descriptors opened before, a /proc
# of the new PID namespace), stays as its PID 1 (reaping; its exit kills what is left)
# and forks the program; then sets the limits, drops privileges and execs the program.
_LAUNCHER = """\
import json, os, resource, signal, sys
a = json.loads(sys.argv[1])
# Python ignores SIGPIPE and SIGXFSZ, and exec keeps ignored signals: the default back,
# so a program writing past RLIMIT_FSIZE dies of SIGXFSZ (Python programs ignore it again
# and get EFBIG)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
if a["cgroup"]:
    with open(a["cgroup"], "w") as f:
        f.write(str(os.getpid()))
if a["ns"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    RO, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
    def mount(src, tgt, fs, flags, data=None):
        enc = lambda x: x.encode() if x else None
        if libc.mount(enc(src), enc(tgt), enc(fs), flags, enc(data)) != 0:
            e = ctypes.get_errno()
            sys.stderr.write(f"sandbox: cannot mount {tgt}: {os.strerror(e)}\\n")
            os._exit(125)
    keep = [(d, os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)) for d in a["keep"]]
    mount(None, "/", None, REC | PRIVATE)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            x = line.split()
            points.append((x[4].encode().decode("unicode_escape"), x[5].split(",")))
    flag = {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC}
    for point, opts in points:
        if os.path.lexists(point):
            mount(None, point, None, REMOUNT | BIND | RO | sum(flag.get(o, 0) for o in opts))
    mount("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV, a["tmpfs"])
    for d in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(d) and not os.path.islink(d):
            mount("/tmp", d, None, BIND)
    for d, fd in sorted(keep, key=lambda x: len(x[0])):
        os.makedirs(d, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", d, None, BIND)
        mount(None, d, None, REMOUNT | BIND | NOSUID | NODEV)
        os.close(fd)
    mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.chdir(a["cwd"])  # the working directory through its new (writable) mount
    child = os.fork()
    if child:
        while True:
            pid, status = os.wait()
            if pid == child:
                break
        os.write(a["status_fd"], str(status).encode())
        os._exit(0)
    os.close(a["status_fd"])
for r, v in ((resource.RLIMIT_CPU, (a["cpu"], a["cpu"] + 1)),
             (resource.RLIMIT_AS, (a["mem"], a["mem"])),
             (resource.RLIMIT_NPROC, (a["nproc"], a["nproc"])),
             (resource.RLIMIT_FSIZE, (a["fsize"], a["fsize"])),
             (resource.RLIMIT_NOFILE, (a["nofile"], a["nofile"])),
             (resource.RLIMIT_CORE, (0, 0))):
    resource.setrlimit(r, v)
if a["uid"] is not None:
    os.setgroups([])
    os.setgid(a["gid"])
    os.setuid(a["uid"])
try:
    os.execv(a["argv"][0], a["argv"])
except OSError as e:
    sys.stderr.write(f"sandbox: cannot run {a['argv'][0]}: {e}\\n")
    os._exit(126)
"""


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
    user: str = "nobody"  # dropped to when running as root ("" keeps root)
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


@dataclass(frozen=True)
class Result:
    returncode: int | None  # None when killed at the wall timeout; -N: killed by signal N
    stdout: str
    stderr: str
    timed_out: bool  # the wall timeout killed it
    limit: str | None  # which limit stopped it: "wall", "cpu", "fsize" (None: none did)
    wall_s: float
    truncated: bool  # stdout or stderr was cut at max_output
    network_isolated: bool
    pids_cgroup: bool  # a pids cgroup of its own bounded and cleaned up the run
    fs_isolated: bool = False  # mount, PID and IPC namespaces (read-only system, private /tmp)
    uid: int | None = None  # the uid the program ran as (None: this process's)

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


def _drop_kwargs(ids: tuple[int, int] | None) -> dict:
    if ids is None:
        return {}
    return dict(user=ids[0], group=ids[1], extra_groups=[])


_INTERPRETER: dict[tuple, str] = {}


def interpreter(limits: Limits) -> str:
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
                r = run(["/bin/sh", "-c", "touch /etc/.tsync-probe 2>/dev/null; ls /proc"],
                        limits=Limits(user="", network="host", isolation="require"),
                        _probe=True)
                pids = [x for x in r.stdout.split() if x.isdigit()]
                if r.returncode != 0 or os.path.exists("/etc/.tsync-probe") or len(pids) > 3:
                    why = f"the namespaces did not hold: {(r.stderr or r.stdout)[:200]!r}"
            except (OSError, SandboxError) as e:
                why = f"unshare {' '.join(NS_FLAGS)} failed: {e}"
        _FS_NS.append(why)
    return _FS_NS[0]


_CGROUP: list[str | None] = []
_CG_PARENT = "tsync-sandbox"


def pids_cgroup_root() -> str | None:
    """A writable pids-cgroup directory to make per-run cgroups in, or None (probed once):
    cgroup v1 /sys/fs/cgroup/pids, or cgroup v2 with the pids controller enabled."""
    if _CGROUP:
        return _CGROUP[0]
    found = None
    if os.geteuid() == 0:
        for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
            parent = os.path.join(base, _CG_PARENT)
            probe = os.path.join(parent, f"probe-{os.getpid()}")
            try:
                os.makedirs(probe, exist_ok=True)
                with open(os.path.join(probe, "pids.max"), "w") as f:
                    f.write("8")
                os.rmdir(probe)
                found = parent
                break
            except OSError:
                try:
                    os.rmdir(probe)
                except OSError:
                    pass
    _CGROUP.append(found)
    return found


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


def _mount_call(*args) -> int:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fn, rest = args[0], args[1:]
    rc = getattr(libc, fn)(*[a.encode() if isinstance(a, str) else a for a in rest])
    return 0 if rc == 0 else ctypes.get_errno()


def episode_dir(limits: Limits, prefix: str = "tsync-episode-") -> str:
    """A kept work directory for one episode (a terminal task's repo). Where the sandbox
    makes namespaces (root), a tmpfs of its own bounded by `disk_mb` / `disk_inodes`, so
    what the episode's calls write is bounded in bytes and files; else a plain temporary
    directory. `remove_episode_dir` undoes either."""
    d = tempfile.mkdtemp(prefix=prefix)
    if limits.isolation != "none" and not fs_isolation():
        opts = f"size={limits.disk_mb}m,nr_inodes={limits.disk_inodes},mode=0700"
        err = _mount_call("mount", "tmpfs", d, "tmpfs", 2 | 4, opts)  # nosuid, nodev
        if err:
            os.rmdir(d)
            raise SandboxError(f"sandbox: cannot mount the episode's tmpfs on {d}: "
                               f"{os.strerror(err)}")
    return d


def remove_episode_dir(path: str) -> None:
    """Remove an `episode_dir` (its tmpfs detached first, whatever it holds)."""
    if os.path.ismount(path):
        _mount_call("umount2", path, 2)  # MNT_DETACH
    shutil.rmtree(path, ignore_errors=True)


def _make_cgroup(root: str, nproc: int) -> str | None:
    d = tempfile.mkdtemp(prefix="run-", dir=root)
    try:
        with open(os.path.join(d, "pids.max"), "w") as f:
            f.write(str(nproc))
    except OSError:
        os.rmdir(d)
        return None
    return d


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


def _kill_cgroup(cg: str, wait_s: float = 5.0) -> None:
    """SIGKILL every process of the run's cgroup (setsid escapees too), then remove it."""
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
            _warn_once(f"sandbox cgroup {cg} still has processes after {wait_s}s")
            return
        time.sleep(0.01)
    for _ in range(100):
        try:
            os.rmdir(cg)
            return
        except OSError:
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


def run(argv: Sequence[str], *, limits: Limits = Limits(), stdin: str = "",
        workdir: str | None = None, template: str | None = None,
        files: Mapping[str, str] | None = None, _probe: bool = False) -> Result:
    """Run `argv` in the sandbox. The working directory is `workdir` (kept; made the sandbox
    user's) or a fresh temporary one seeded from `template` (removed). `files` (name ->
    text) are written into the run's temporary directory first; an `InRun` name in
    `argv` becomes a path in it (it is the working directory unless `workdir` is given)."""
    if not argv:
        raise SandboxError("sandbox: empty command")
    why = _unrunnable(argv, stdin, files)
    if why:  # what the model wrote cannot reach a program: its own error, exit status 2
        return Result(2, "", f"error: {why}\n", False, None, 0.0, False, False, False)
    ids = _ids(limits.user)
    prefix: list[str] = []
    isolated = False
    if limits.network != "host":
        prefix, why = netns_prefix()
        isolated = bool(prefix)
        if not isolated:
            if limits.network == "require":
                raise SandboxError(f"sandbox: network isolation required but {why}")
            _warn_once(f"sandbox runs WITH network access: {why}")
    fs_ns = False
    if limits.isolation != "none":
        why = "" if _probe else fs_isolation()
        fs_ns = not why
        if why:
            if limits.isolation == "require":
                raise SandboxError(f"sandbox: filesystem isolation required but {why}")
            _warn_once(f"sandbox runs WITHOUT mount/PID/IPC namespaces: {why}")
        elif not prefix:
            prefix = [UNSHARE, *NS_FLAGS, "--"]
        else:
            prefix = [*prefix[:-1], *NS_FLAGS, "--"]
    cg_root = pids_cgroup_root()
    exe = interpreter(limits)
    launcher_python = sys.executable  # runs as the caller (root) before the drop
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tsync-sandbox-") as rundir, \
            tempfile.TemporaryDirectory(prefix="tsync-sandbox-io-") as io:
        os.chmod(io, 0o700)
        if template:
            shutil.copytree(template, rundir, dirs_exist_ok=True, symlinks=True)
        # `python`/`python3` on PATH: the interpreter the sandbox user can run
        bindir = os.path.join(rundir, ".sandbox-bin")
        os.mkdir(bindir)
        for alias in ("python", "python3"):
            os.symlink(exe, os.path.join(bindir, alias))
        for name, text in (files or {}).items():
            with open(os.path.join(rundir, name), "w", encoding="utf-8") as f:
                f.write(text)
        cwd = workdir or rundir
        if ids is not None and limits.uid_base:
            ids = _run_ids(workdir, limits.uid_base)
        if ids is not None:
            _chown_tree(rundir, ids)
            if workdir:
                _chown_tree(workdir, ids)
        cg = _make_cgroup(cg_root, limits.nproc) if cg_root else None
        args = dict(
            argv=[os.path.join(rundir, a) if isinstance(a, InRun) else a for a in argv],
            cpu=int(limits.cpu_s) or max(1, int(limits.timeout_s + 0.999)),
            mem=limits.memory_mb << 20, fsize=limits.fsize_mb << 20, nofile=limits.nofile,
            nproc=limits.nproc_user if cg else limits.nproc,
            cgroup=os.path.join(cg, "cgroup.procs") if cg else "",
            uid=ids[0] if ids else None, gid=ids[1] if ids else None, ns=fs_ns,
            keep=[rundir, *([os.path.abspath(workdir)] if workdir else [])], cwd=cwd,
            tmpfs=f"size={limits.disk_mb}m,nr_inodes={limits.disk_inodes},mode=1777",
            status_fd=-1)
        env = {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "HOME": rundir, "TMPDIR": rundir,
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        out_path, err_path = os.path.join(io, "stdout"), os.path.join(io, "stderr")
        in_path = os.path.join(io, "stdin")
        with open(in_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        timed_out = False
        status_r = status_w = -1
        if fs_ns:  # PID 1 of the namespace reports the program's wait status here
            status_r, status_w = os.pipe()
            os.set_blocking(status_r, False)
            args["status_fd"] = status_w
        try:
            with open(in_path, "rb") as fin, open(out_path, "wb") as fout, \
                    open(err_path, "wb") as ferr:
                try:
                    proc = subprocess.Popen(
                        [*prefix, launcher_python, "-I", "-S", "-c", _LAUNCHER,
                         json.dumps(args)],
                        cwd=cwd, env=env, stdin=fin, stdout=fout, stderr=ferr,
                        start_new_session=True, close_fds=True,
                        pass_fds=(status_w,) if fs_ns else ())
                except OSError as e:
                    raise SandboxError(f"sandbox: cannot start {argv[0]}: {e}") from None
                finally:
                    if status_w >= 0:
                        os.close(status_w)
                try:
                    proc.wait(timeout=limits.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(proc.pid, wait_s=0.0)
                    proc.wait()  # the leader reaped: what is left of the group are children
                    # (until gone: killed ones stay in the group until init reaps them)
                    _kill_group(proc.pid)
        finally:
            if cg:
                _kill_cgroup(cg)
            status = b""
            if status_r >= 0:
                try:
                    status = os.read(status_r, 64)
                except BlockingIOError:  # nobody wrote it (killed at the wall timeout)
                    pass
                os.close(status_r)
        wall = time.monotonic() - t0
        out, t1 = _read(out_path, limits.max_output)
        err, t2 = _read(err_path, limits.max_output)
    rc = None if timed_out else proc.returncode
    if rc is not None and status.isdigit():  # PID 1's report (only root held that pipe)
        rc = os.waitstatus_to_exitcode(int(status))
    limit = ("wall" if timed_out else
             "cpu" if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and
                                                _cpu_killed(args["cpu"], wall)) else
             "fsize" if rc == -signal.SIGXFSZ else None)
    return Result(rc, out, err, timed_out, limit, wall, t1 or t2, isolated, cg is not None,
                  fs_ns, ids[0] if ids else None)


def _cpu_killed(cpu_s: int, wall_s: float) -> bool:
    # SIGKILL without a wall timeout: the hard CPU limit (a program ignoring SIGXCPU) when
    # it ran at least that long; else something else killed it.
    return wall_s >= cpu_s + 1 - 0.05


def run_shell(command: str, *, limits: Limits = Limits(), **kw) -> Result:
    """`command` run by bash (no profile or rc files)."""
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    return run([shell, "-c", command] if shell == "/bin/sh" else
               [shell, "--noprofile", "--norc", "-c", command], limits=limits, **kw)


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
