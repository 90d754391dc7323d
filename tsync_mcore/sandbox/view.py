"""What the jail shows of the host's filesystem beyond the read-only system, and the episode
directories it keeps between calls.

The interpreter view: this process's Python (a venv under /root, say) made runnable by the
jailed uid. Directories on its paths that the uid cannot traverse (/root, mode 0700) are
covered by an empty tmpfs inside the jail, and only the interpreter's prefix
(`sys.base_prefix`), the venv (`sys.prefix`), the site-packages directories and the source
directories of editable installs (the project's packages) are bound back, read-only.

Episode directories (`episode_dir`): a terminal episode's repo, a tmpfs of its own bounded in
bytes and files, named with the owning process's pid so that one left mounted by a killed
process is found and removed (`clean_stale_episodes`, once per process)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import site
import stat
import sys
import tempfile

# directories every jail covers with tmpfs of its own (what lies under them is bound in)
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/var/run")


def _editable_mapping() -> dict[str, str]:
    """Package name -> directory, of the editable installs (setuptools' finder modules)."""
    out = {}
    for name, mod in list(sys.modules.items()):
        mapping = getattr(mod, "MAPPING", None) if name.startswith("__editable__") else None
        if isinstance(mapping, dict):
            out.update({k: v for k, v in mapping.items() if isinstance(v, str)})
    return out


def source_overlay() -> tuple[str, str] | None:
    """(this process's tsync_mcore, the editable install's) when they differ — a checkout
    run with PYTHONPATH beside the one installed: the jail shows this one in the installed
    one's place, so a jailed `python -I -m tsync_mcore...` runs the caller's code."""
    pkg = sys.modules.get("tsync_mcore")
    mapped = _editable_mapping().get("tsync_mcore")
    if pkg is None or not getattr(pkg, "__path__", None) or not mapped:
        return None
    mine = os.path.realpath(list(pkg.__path__)[0])
    return (mine, os.path.realpath(mapped)) if mine != os.path.realpath(mapped) else None


def interpreter_paths() -> list[str]:
    """The directories the jail's Python needs, real paths (links resolved)."""
    paths = [sys.base_prefix, sys.prefix, os.path.dirname(sys.executable)]
    try:
        paths += site.getsitepackages()
    except AttributeError:  # pragma: no cover - virtualenv's old site.py
        pass
    paths += list(_editable_mapping().values())
    pkg = sys.modules.get("tsync_mcore")
    if pkg is not None and getattr(pkg, "__path__", None):
        paths.append(list(pkg.__path__)[0])  # the project's own source, wherever it lives
    out = []
    for p in paths:
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if os.path.isdir(q) and q not in out:
                out.append(q)
    return out


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _traversable(st: os.stat_result, uid: int | None) -> bool:
    if uid is not None and st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    return bool(st.st_mode & stat.S_IXOTH)


def covers_for(paths: list[str], uid: int | None) -> list[str]:
    """The topmost ancestors of `paths` that `uid` cannot traverse (outside PRIVATE)."""
    out: list[str] = []
    for p in paths:
        if any(_under(p, t) for t in PRIVATE) or any(_under(p, c) for c in out):
            continue
        parts = p.strip("/").split("/")
        for i in range(1, len(parts)):
            anc = "/" + "/".join(parts[:i])
            try:
                st = os.stat(anc)
            except OSError:
                break
            if not _traversable(st, uid):
                out.append(anc)
                break
    return out


def needs_bind(path: str, covers: list[str]) -> bool:
    """A path the jail hides (under a cover or a private tmpfs) unless bound back."""
    return any(_under(path, c) and path != c for c in [*covers, *PRIVATE])


def host_sockets(shown: list[str]) -> list[str]:
    """Paths of the host's listening Unix sockets outside the jail's private directories and
    the directories it shows on purpose (`shown`): the jail masks each with an empty file."""
    out = set()
    try:
        with open("/proc/net/unix", errors="replace") as f:
            next(f, None)
            for line in f:
                x = line.split(None, 7)
                if len(x) == 8 and x[7].startswith("/"):
                    out.add(x[7].rstrip("\n"))
    except OSError:
        return []
    return sorted(p for p in out if not any(_under(p, t) for t in (*PRIVATE, *shown)))


# --- episode directories ------------------------------------------------------------------

_EPISODE = re.compile(r"^tsync-[A-Za-z0-9_]+-p(\d+)-")
_CLEANED: list[bool] = []


def _umount(path: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    # MNT_DETACH | UMOUNT_NOFOLLOW: a name swapped for a link unmounts nothing elsewhere
    return 0 if libc.umount2(path.encode(), 2 | 8) == 0 else ctypes.get_errno()


def _mount_tmpfs(path: str, opts: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(b"tmpfs", path.encode(), b"tmpfs", 2 | 4, opts.encode())  # nosuid, nodev
    return 0 if rc == 0 else ctypes.get_errno()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_episodes(tmp: str | None = None) -> list[str]:
    """Unmount and remove episode directories (and the jail's staging directories) whose
    owning process is gone (a rollout killed with SIGKILL leaves its episodes' tmpfs
    mounted); the ones removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for n in names:
        m = _EPISODE.match(n)
        if not m or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        path = os.path.join(tmp, n)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue  # a link is left alone (rmtree and the umount follow none either)
        while os.path.ismount(path):
            if _umount(path):
                break
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def episode_dir(bounded: bool, disk_mb: int, disk_inodes: int,
                prefix: str = "tsync-episode-") -> str:
    """A kept work directory for one episode, named for this process (`clean_stale_episodes`).
    `bounded`: a tmpfs of its own of `disk_mb` / `disk_inodes`; else a plain directory."""
    if not _CLEANED:
        _CLEANED.append(True)
        clean_stale_episodes()
    d = tempfile.mkdtemp(prefix=f"{prefix.rstrip('-')}-p{os.getpid()}-")
    if bounded:
        err = _mount_tmpfs(d, f"size={disk_mb}m,nr_inodes={disk_inodes},mode=0700")
        if err:
            os.rmdir(d)
            raise OSError(err, f"cannot mount the episode's tmpfs on {d}: {os.strerror(err)}")
    return d


def remove_episode_dir(path: str) -> None:
    """Remove an `episode_dir` (its tmpfs detached first, whatever it holds)."""
    if os.path.ismount(path):
        _umount(path)
    shutil.rmtree(path, ignore_errors=True)
