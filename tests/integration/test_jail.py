"""The jail's API (tsync_mcore.sandbox.jail: start/Job, env, expose, binds, loopback, the
interpreter view) and the sandbox findings of issue 47 through the tools as agents call
them (ToolBox), the code sandbox (rewards.sandbox) and a rollout's episode directories.

What must hold: a jailed program reaches no host Unix socket, writes nothing unbounded
(HOME/TMPDIR on the call's tmpfs, memfds counted by a memory cgroup), cannot make
namespaces, mount, ptrace or use keyrings (seccomp), while normal programs run; an episode
tmpfs a killed process left is removed; a long command runs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tsync_mcore.rewards.sandbox import SandboxLimits
from tsync_mcore.rewards.sandbox import run_python as reward_run_python
from tsync_mcore.sandbox import cgroups
from tsync_mcore.sandbox import jail as sb
from tsync_mcore.sandbox.tools import ToolBox

ROOT = os.geteuid() == 0
LIM = sb.Limits(timeout_s=20.0, memory_mb=256, nproc=16)
needs_root = pytest.mark.skipif(not ROOT, reason="the jail's namespaces need root")


def bash(command: str, limits: sb.Limits = LIM) -> str:
    return ToolBox(limits).call_sync("bash", {"command": command})


def python(code: str, limits: sb.Limits = LIM) -> str:
    return ToolBox(limits).call_sync("python", {"code": code})


# --- the API ------------------------------------------------------------------------------

@needs_root
def test_the_jail_runs_this_venvs_python_and_packages_as_a_non_root_uid():
    exe = sb.interpreter(LIM)
    assert exe == sys.executable  # no longer the system python3 (/root is 0700)
    # the caller's own tsync_mcore (a checkout beside the editable install's: shown in its
    # place), here a module that only this branch has
    r = sb.run([exe, "-I", "-c", "import os, sys, tsync_mcore, reasoning_gym, openai; "
                                 "import tsync_mcore.sandbox.launcher; "
                                 "print(os.getuid(), sys.prefix == sys.base_prefix)"],
               limits=sb.Limits(timeout_s=60.0, memory_mb=2048))
    assert r.returncode == 0 and r.uid and r.stdout.split()[0] == str(r.uid) != "0", r
    # /root is covered: only the interpreter's directories are bound back, read-only
    r = sb.run_shell("ls -A /root; touch /root/x 2>&1 || true; "
                     f"touch {sys.base_prefix}/x 2>&1 || true", limits=LIM)
    listed = r.stdout.split("\n")[0].split()
    assert set(listed) <= {".pyenv", ".cache", ".local"}, r
    assert "Read-only file system" in r.stdout, r


@needs_root
def test_a_started_job_talks_through_pipes_and_is_killed_from_another_thread(tmp_path):
    prog = ("import os, sys\nprint(os.environ['JOB_TOKEN'], flush=True)\n"
            "for line in sys.stdin:\n    print(line.strip().upper(), flush=True)\n")
    job = sb.start([sb.interpreter(LIM), "-I", "-c", prog], limits=LIM, pipes=True,
                   env={"JOB_TOKEN": "t0k"})
    assert job.stdout.readline() == b"t0k\n" and job.uid not in (None, 0)
    job.stdin.write(b"ping\n")
    job.stdin.flush()
    assert job.stdout.readline() == b"PING\n"
    results = []
    waiter = threading.Thread(target=lambda: results.append(job.wait(60)))
    waiter.start()
    time.sleep(0.2)
    killed = job.kill()
    waiter.join(10)
    assert results == [killed] and killed.returncode == -signal.SIGKILL, killed
    assert killed.limit is None and not killed.timed_out
    assert job.poll() is not None
    # a job that ends by itself; wait's timeout is the wall limit
    job = sb.start(["/bin/sh", "-c", "sleep 30"], limits=LIM)
    r = job.wait(0.5)
    assert r.timed_out and r.limit == "wall" and job.wait() is r
    for bad in ({"PATH": "/x"}, {"A B": "1"}, {"X": "a\x00b"}, {"HOME": "/"}):
        with pytest.raises(sb.SandboxError, match="environment variable"):
            sb.start(["/bin/true"], limits=LIM, env=bad)


@needs_root
def test_loopback_inside_binds_writable_expose_read_only(tmp_path):
    shared, shown = tmp_path / "shared", tmp_path / "shown"
    shared.mkdir()
    shown.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shared, 0o777)
    (shown / "f.txt").write_text("visible")
    lim = sb.Limits(timeout_s=20.0, memory_mb=512, loopback=True, binds=(str(shared),),
                    expose=(str(shown),))
    prog = (
        "import socket, threading\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "def serve():\n    c, _ = s.accept(); c.sendall(c.recv(16).upper()); c.close()\n"
        "threading.Thread(target=serve, daemon=True).start()\n"
        "c = socket.create_connection(s.getsockname()); c.sendall(b'over lo')\n"
        "print(c.recv(16).decode())\n"
        f"open({str(shared / 'out.txt')!r}, 'w').write('written')\n"
        f"print(open({str(shown / 'f.txt')!r}).read())\n"
        "try:\n"
        f"    open({str(shown / 'g.txt')!r}, 'w')\n"
        "except OSError as e:\n    print(e.strerror)\n")
    r = sb.run_python(prog, limits=lim)
    assert r.stdout.split("\n")[:3] == ["OVER LO", "visible", "Read-only file system"], r
    assert (shared / "out.txt").read_text() == "written"
    assert not (shown / "g.txt").exists()
    # without loopback, lo stays down; expose/binds need the mount namespace
    r = sb.run_python(prog, limits=LIM)
    assert "OVER LO" not in r.stdout and "Network is unreachable" in r.stderr, r
    with pytest.raises(ValueError, match="absolute paths"):
        sb.Limits(binds=("relative",))


# --- finding 4: no host Unix sockets ------------------------------------------------------

@needs_root
def test_a_tool_call_reaches_no_host_unix_socket():
    path = f"/run/tsync-test-{os.getpid()}.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen()
    elsewhere = tempfile.mkdtemp(prefix=".tsync-test-sock-", dir=os.getcwd())
    os.chmod(elsewhere, 0o755)
    other = socket.socket(socket.AF_UNIX)
    other.bind(os.path.join(elsewhere, "s"))
    os.chmod(os.path.join(elsewhere, "s"), 0o777)
    other.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0tsync-test-{os.getpid()}")
    abstract.listen()
    try:
        prog = ("import socket\n"
                f"for p in ({path!r}, {path.replace('/run', '/var/run')!r}, "
                f"'\\0tsync-test-{os.getpid()}', {os.path.join(elsewhere, 's')!r}):\n"
                "    s = socket.socket(socket.AF_UNIX)\n"
                "    try:\n        s.connect(p); print('connected', p)\n"
                "    except OSError as e:\n        print('refused', e.errno)\n")
        out = python(prog)
        assert "connected" not in out and out.count("refused") == 4, out
        # nothing of the caller's is inherited: stdin, stdout, stderr (and listdir's own)
        assert python("import os\nprint(sorted(os.listdir('/proc/self/fd')))") == \
            "exit code: 0\nstdout:\n['0', '1', '2', '3']"
        assert bash("ls -A /run /var/run") == "exit code: 0\nstdout:\n/run:\n\n/var/run:"
        # a directory bound in on purpose (an agent's endpoint socket) stays reachable
        r = sb.run_python(prog, limits=sb.Limits(binds=(elsewhere,)))
        assert r.stdout.split("\n")[3] == f"connected {elsewhere}/s", r
    finally:
        srv.close()
        abstract.close()
        other.close()
        os.unlink(path)
        shutil.rmtree(elsewhere)


# --- finding 8: every writable place bounded; seccomp; stale episodes ---------------------

@needs_root
def test_home_and_tmpdir_are_on_the_calls_bounded_tmpfs():
    lim = sb.Limits(timeout_s=20.0, memory_mb=256, disk_mb=8, disk_inodes=512)
    out = bash('{ for d in "$HOME" "$TMPDIR" "$PWD"; do for i in 1 2 3; do '
               'head -c 15M /dev/zero > "$d/f$i"; done; done; '
               'for i in $(seq 1 2000); do : > "$HOME/n$i" || break; done; } 2>/dev/null; '
               'du -smc "$HOME" "$TMPDIR" "$PWD" | tail -1; ls "$HOME" | wc -l', lim)
    mb, files = out.split("stdout:\n")[1].split()[0], out.split()[-1]
    assert int(mb) <= 9 and int(files) <= 512, out
    # the code sandbox too
    r = reward_run_python("import os\nh = os.environ['HOME']\n"
                          "for i in range(40):\n"
                          "    try:\n"
                          "        open(f'{h}/f{i}', 'wb').write(b'x' * (15 << 20))\n"
                          "    except OSError as e:\n"
                          "        print(e.strerror); break\n",
                          limits=SandboxLimits(timeout_s=20.0, memory_mb=512))
    assert r.stdout.strip() == "No space left on device", r


@needs_root
def test_memfd_and_tmpfs_pages_count_against_the_calls_memory():
    shmem = lambda: int([x for x in open("/proc/meminfo") if x.startswith("Shmem:")][0]  # noqa
                        .split()[1]) >> 10
    before = shmem()
    out = python("import os\nfds = []\nfor i in range(50):\n"
                 "    fd = os.memfd_create('x'); os.write(fd, b'a' * (15 << 20)); fds.append(fd)\n"
                 "print('grew', 15 * len(fds), 'MB', flush=True)\n")
    assert out.startswith("killed: memory limit") and "grew" not in out, out
    assert shmem() - before < 200  # nothing left behind (other tests may run meanwhile)


@needs_root
def test_seccomp_denies_namespaces_mounts_ptrace_keyrings_and_normal_programs_run():
    out = bash("unshare -U true; echo rc=$?; unshare -n true; echo rc=$?; "
               "cat /proc/self/status | grep -E '^(NoNewPrivs|Seccomp):'")
    assert out.count("unshare failed: Operation not permitted") == 2, out
    assert "NoNewPrivs:\t1" in out and "Seccomp:\t2" in out, out
    out = python(
        "import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def err(rc):\n    return 'ok' if rc >= 0 else os.strerror(ctypes.get_errno())\n"
        "print('unshare', err(libc.unshare(0x10000000)))\n"
        "print('mount', err(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)))\n"
        "child = os.fork()\n"
        "if child == 0:\n    time.sleep(5); os._exit(0)\n"
        "print('ptrace', err(libc.ptrace(16, child, None, None)))\n"  # PTRACE_ATTACH
        "os.kill(child, 9); os.wait()\n"
        "print('keyctl', err(libc.syscall(250 if os.uname().machine == 'x86_64' else 219,"
        " 0, 0)))\n"
        "import socket\n"
        "for name, family in (('AF_ALG', 38), ('AF_VSOCK', 40)):\n"
        "    try:\n        socket.socket(family, socket.SOCK_SEQPACKET); print(name, 'ok')\n"
        "    except OSError as e:\n        print(name, e.strerror)\n")
    for call in ("unshare", "mount", "ptrace", "keyctl"):
        assert f"{call} Operation not permitted" in out, out
    assert "AF_ALG Address family not supported by protocol" in out, out
    assert "AF_VSOCK Address family not supported by protocol" in out, out
    out = python(
        "import multiprocessing as mp, subprocess, threading\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "print(subprocess.run(['bash', '-c', 'echo sub; (sleep 0.1 &); wait'],"
        " capture_output=True, text=True).stdout.strip())\n"
        "with mp.Pool(2) as p:\n    print(sum(p.map(abs, [-1, -2])))\n"
        # ptys work, from a devpts of its own: none of the host's, at most 16
        "import os, pty\nfds = []\ntry:\n    while len(fds) < 40:\n"
        "        fds.append(pty.openpty())\nexcept OSError:\n    pass\n"
        "print(len(fds), len(os.listdir('/dev/pts')) - 1)\n")
    assert out == "exit code: 0\nstdout:\nthread\nsub\n3\n16 16", out


@needs_root
def test_an_episode_tmpfs_left_by_a_killed_rollout_is_removed_at_the_next_start(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    left = subprocess.run(
        [sys.executable, "-c",
         "import os, signal\nfrom tsync_mcore.sandbox import jail as sb\n"
         "lim = sb.Limits(uid_base=1 << 24)\n"
         "d = sb.episode_dir(lim, prefix='tsync-terminal-')\n"
         "assert sb.run_shell('echo x > x', limits=lim, workdir=d).returncode == 0\n"
         "job = sb.start(['/bin/sleep', '1000'], limits=sb.Limits(timeout_s=1000))\n"
         "print(d, os.getpid(), flush=True)\n"
         "os.kill(os.getpid(), signal.SIGKILL)\n"],
        capture_output=True, text=True, env=env, timeout=120).stdout.split()
    left, pid = left[0], int(left[1])  # its episode, a call's cgroups and staging dir left
    assert os.path.ismount(left)

    def leftovers() -> list[str]:
        cgs = [os.path.join(r, n) for r in (cgroups.pids_root(), cgroups.memory_root()) if r
               for n in os.listdir(r) if n.startswith(f"run-p{pid}-")]
        return cgs + [n for n in os.listdir(tempfile.gettempdir()) if f"-p{pid}-" in n]
    assert len(leftovers()) >= 3
    try:
        r = subprocess.run([sys.executable, "-c", "from tsync_mcore.sandbox import jail as sb\n"
                                                  "print(sb.run_shell('echo ok').stdout)"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.stdout.strip() == "ok", r.stderr
        assert not os.path.ismount(left) and not os.path.exists(left)
        assert leftovers() == []  # the orphaned `sleep 1000` killed with its cgroups
    finally:
        if os.path.ismount(left):
            subprocess.run(["umount", "-l", left])
        subprocess.run(["rm", "-rf", left])


# --- finding 16(a): a long command ---------------------------------------------------------

def test_a_200_kb_bash_command_runs():
    payload = "a" * 200_000
    out = bash(f"cat > big.txt <<'EOF'\n{payload}\nEOF\nwc -c < big.txt; echo $0 | wc -c")
    assert out.startswith("exit code: 0\nstdout:\n200001\n"), out[:300]
