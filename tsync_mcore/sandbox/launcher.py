"""The jail's launcher: run as `python -I -S launcher.py SPEC` (stdlib only, imports nothing of
tsync_mcore), as the caller (root) inside the new namespaces, it builds the program's view
and limits and then execs the program (tsync_mcore/sandbox/jail.py starts it).

In order: join the call's cgroups; bring `lo` up (a loopback jail); in a mount + PID
namespace: every mount read-only, a private tmpfs on /tmp (/var/tmp and /dev/shm the same),
an empty one on /run (and /var/run), a devpts of its own, empty tmpfs covers over
directories the jailed uid cannot traverse (/root), then the call's directories bound in —
read-only (the interpreter's prefixes, `expose`) or writable (the work directory, `binds`)
— through descriptors opened before anything was covered, the host's other Unix sockets
covered by an empty file, the call's staged run directory copied onto the tmpfs, a /proc
of the new PID namespace; fork the program and stay its PID 1 (its exit
kills what is left); then rlimits, the uid drop, no-new-privs and the seccomp filter, exec.
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import stat
import struct
import sys

RO, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

libc = ctypes.CDLL(None, use_errno=True)


def die(msg: str, code: int = 125) -> None:
    sys.stderr.write(f"sandbox: {msg}\n")
    os._exit(code)


def mount(src, tgt, fs, flags, data=None) -> None:
    enc = lambda x: x.encode() if x else None  # noqa: E731
    if libc.mount(enc(src), enc(tgt), enc(fs), flags, enc(data)) != 0:
        die(f"cannot mount {tgt}: {os.strerror(ctypes.get_errno())}")


def loopback_up() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0))
        flags = struct.unpack("16sH22x", req)[1] | IFF_UP
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags))
    except OSError as e:
        die(f"cannot bring up the loopback interface: {e}")
    finally:
        s.close()


def mount_points() -> list[tuple[str, list[str]]]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            x = line.split()
            out.append((x[4].encode().decode("unicode_escape"), x[5].split(",")))
    return out


def copy_tree(src: str, dst: str, ids) -> None:
    """The staged run directory (root's, written by the jail) onto the call's tmpfs."""
    os.mkdir(dst, 0o700)
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        out = dst if rel == "." else os.path.join(dst, rel)
        for n in dirs + files:
            s, d = os.path.join(root, n), os.path.join(out, n)
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(d, 0o700)
            elif stat.S_ISREG(st.st_mode):
                with open(s, "rb") as fi, open(d, "wb") as fo:
                    while chunk := fi.read(1 << 20):
                        fo.write(chunk)
                os.chmod(d, stat.S_IMODE(st.st_mode))
            else:
                continue
            if ids:
                os.chown(d, *ids, follow_symlinks=False)
    if ids:
        os.chown(dst, *ids)


def build_view(a: dict, ids) -> None:
    """The program's filesystem (see the module's docstring)."""
    opened = []  # (where, fd, writable): opened before any cover hides them
    for src, dst, writable in a["binds"]:
        try:
            opened.append((dst, os.open(src, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW),
                           writable))
        except OSError as e:
            die(f"cannot open {src} to bind it in: {e}")
    stage = os.open(a["stage"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW) if a["stage"] \
        else -1
    mount(None, "/", None, REC | PRIVATE)
    flag = {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC}
    for point, opts in mount_points():
        if os.path.lexists(point):
            mount(None, point, None, REMOUNT | BIND | RO | sum(flag.get(o, 0) for o in opts))
    mount("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV, a["tmpfs"])
    for d in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(d) and not os.path.islink(d):
            mount("/tmp", d, None, BIND)
    # no host Unix sockets, pid files or locks: an empty, read-only /run
    if os.path.isdir("/run") and not os.path.islink("/run"):
        mount("tmpfs", "/run", "tmpfs", NOSUID | NODEV | NOEXEC, "size=16k,nr_inodes=16,mode=0755")
    if os.path.isdir("/var/run") and not os.path.islink("/var/run"):
        mount("/run", "/var/run", None, BIND)
    # ptys of its own (at most 16): none of the host's, and no way to use up the host's
    if os.path.isdir("/dev/pts") and os.path.exists("/dev/ptmx"):
        mount("devpts", "/dev/pts", "devpts", NOSUID | NOEXEC,
              "newinstance,ptmxmode=0666,mode=0620,max=16")
        mount("/dev/pts/ptmx", "/dev/ptmx", None, BIND)
    covers = [c for c in a["covers"] if os.path.isdir(c) and not os.path.islink(c)]
    for c in covers:
        mount("tmpfs", c, "tmpfs", NOSUID | NODEV, "size=16k,nr_inodes=1024,mode=0755")
    for path, fd, writable in sorted(opened, key=lambda x: len(x[0])):
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, BIND)
        mount(None, path, None, REMOUNT | BIND | NOSUID | NODEV | (0 if writable else RO))
        os.close(fd)
    for c in covers:
        mount(None, c, None, REMOUNT | RO | NOSUID | NODEV)
    for sock in a["masks"]:  # the host's other Unix sockets: an empty file in their place
        try:
            if not stat.S_ISSOCK(os.lstat(sock).st_mode):
                continue
        except OSError:
            continue  # gone meanwhile
        mount("/dev/null", sock, None, BIND)
    if stage >= 0:
        try:
            copy_tree(f"/proc/self/fd/{stage}", a["rundir"], ids)
        except OSError as e:
            die(f"cannot copy the call's files onto its tmpfs ({a['tmpfs']}): {e}")
        os.close(stage)
    if os.path.isdir("/run"):
        mount(None, "/run", None, REMOUNT | RO | NOSUID | NODEV | NOEXEC)
    mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC)


def install_seccomp(prog: bytes) -> None:
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        die(f"cannot set no_new_privs: {os.strerror(ctypes.get_errno())}")
    buf = ctypes.create_string_buffer(prog, len(prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        die(f"cannot install the seccomp filter: {os.strerror(ctypes.get_errno())}")


def main() -> None:
    a = json.loads(sys.argv[1])
    # Python ignores SIGPIPE and SIGXFSZ, and exec keeps ignored signals: the default back,
    # so a program writing past RLIMIT_FSIZE dies of SIGXFSZ (Python programs ignore it
    # again and get EFBIG)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    for procs in a["cgroups"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    if a["loopback"]:
        loopback_up()
    ids = (a["uid"], a["gid"]) if a["uid"] is not None else None
    if a["ns"]:
        build_view(a, ids)
        os.chdir(a["cwd"])  # the working directory through its new mount
        child = os.fork()
        if child:  # PID 1: reap until the program ends, report its status, exit (kills all)
            while True:
                pid, status = os.wait()
                if pid == child:
                    break
            os.write(a["status_fd"], str(status).encode())
            os._exit(0)
        if a["status_fd"] >= 0:
            os.close(a["status_fd"])
    for r, v in ((resource.RLIMIT_CPU, (a["cpu"], a["cpu"] + 1)),
                 (resource.RLIMIT_AS, (a["mem"], a["mem"])),
                 (resource.RLIMIT_NPROC, (a["nproc"], a["nproc"])),
                 (resource.RLIMIT_FSIZE, (a["fsize"], a["fsize"])),
                 (resource.RLIMIT_NOFILE, (a["nofile"], a["nofile"])),
                 (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(r, v)
    if ids is not None:
        os.setgroups([])
        os.setgid(ids[1])
        os.setuid(ids[0])
    if a["seccomp"]:
        install_seccomp(bytes.fromhex(a["seccomp"]))
    try:
        os.execv(a["argv"][0], a["argv"])
    except OSError as e:
        die(f"cannot run {a['argv'][0]}: {e}", 126)


if __name__ == "__main__":
    main()
