"""How an agent process starts (rollout.agent_isolation; docs/guide/agents.md#agents-run-jailed):
in the jail (tsync_mcore.sandbox.jail) where it can be made, else as the rollout's user.

A jailed agent (each trajectory's process, each pool worker) runs under a uid of its own in
its own PID, mount, IPC and network namespaces with seccomp: the system read-only, a
private tmpfs for HOME and TMPDIR, the run directory covered, no other process's
/proc/<pid>/environ (its key is in its own environment, which only its uid in its PID
namespace can read). Its network namespace holds only loopback: the forwarder
(tsync_mcore.sandbox.forward) listens on 127.0.0.1:PORT there and carries each connection to
the endpoint's Unix socket, shown in the jail; the agent's OPENAI_BASE_URL names that
port, so the endpoint is the only thing it can reach.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tsync_mcore.sandbox import jail
from tsync_mcore.sandbox.forward import HOST_PATH, PORT

# Agents' uids: a range of their own, beside the tools' episodes (tools.uid_base)
UID_BASE = 1 << 25
# What the jail bounds an agent by; wall time is rollout.agent_timeout_s (or a pool's
# watchdog), memory and CPU are the machine's to share as for an unjailed agent
LIMITS = dict(timeout_s=1e9, cpu_s=1 << 30, memory_mb=1 << 16, nproc=512, nproc_user=4096,
              fsize_mb=1024, nofile=4096, disk_mb=1024, disk_inodes=1 << 16)
# Names the jail sets itself (its private HOME/TMPDIR, PATH to the interpreter it may run)
JAIL_OWN = ("PATH", "HOME", "TMPDIR", "USER", "LOGNAME")


class AgentIsolationError(RuntimeError):
    """rollout.agent_isolation: require where the jail cannot be made, or an agent_expose
    that would show the run directory: the rollout does not start."""


def why_not_jailed() -> str:
    """Why agents cannot run jailed here ("": they can)."""
    if os.geteuid() != 0:
        return "not running as root"
    why = jail.fs_isolation()
    if not why:
        _, why = jail.netns_prefix()
    return why


_WARNED: list[str] = []


class Launcher:
    """Starts agent processes for `server` under `isolation` ("isolate" | "require" |
    "none"); `jailed` says which way they run. `expose`: host paths a jailed agent sees
    read-only (its code, its data); `hide`: paths it must not see (the run directory)."""

    def __init__(self, server: Any, isolation: str = "isolate", *,
                 expose: Sequence[str] = (), hide: Sequence[str] = ()) -> None:
        if isolation not in ("isolate", "require", "none"):
            raise ValueError(f"agent isolation must be 'isolate', 'require' or 'none', "
                             f"got {isolation!r}")
        self.server = server
        why = "" if isolation == "none" else why_not_jailed()
        if why and isolation == "require":
            raise AgentIsolationError(f"rollout.agent_isolation: require, but agents cannot "
                                      f"run jailed here: {why}")
        if why and not _WARNED:
            _WARNED.append(why)
            print(f"[rollout] agents run WITHOUT the jail (as this process's user, with the "
                  f"host's network and files): {why}", file=sys.stderr, flush=True)
        self.jailed = isolation != "none" and not why
        self.expose = tuple(os.path.realpath(p) for p in expose)
        self.hide = tuple(os.path.realpath(p) for p in hide)
        for p in self.expose:
            for h in self.hide:
                if os.path.commonpath([p, h]) in (p, h):
                    raise AgentIsolationError(f"rollout.agent_expose: {p} would show the run "
                                              f"directory {h} to the agents")
        self.cwd = os.getcwd()

    def base_url(self, traj_id: str) -> str:
        """OPENAI_BASE_URL of the trajectory's agent (the forwarder's, when jailed)."""
        if not self.jailed:
            return self.server.base_url(traj_id)
        return f"http://127.0.0.1:{PORT}/t/{traj_id}/v1"

    def pool_url(self) -> str:
        root = (f"http://127.0.0.1:{PORT}" if self.jailed else
                f"http://{self.server.host}:{self.server.port}")
        return root + "/v1/pool"

    async def start(self, command: str, env: dict[str, str], log_path: str) -> AgentProcess:
        """`command` (a shell command) started, its output to `log_path`."""
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        if not self.jailed:
            with open(log_path, "ab") as log:
                proc = await asyncio.create_subprocess_shell(
                    command, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            return AgentProcess(proc=proc)
        return await asyncio.to_thread(self._start_jailed, command, env, log_path)

    def _start_jailed(self, command: str, env: dict[str, str], log_path: str
                      ) -> AgentProcess:
        sock = self.server.unix_path
        # the socket's directory read-only (connecting needs no write access to the mount)
        limits = jail.Limits(**LIMITS, network="require", isolation="require", loopback=True,
                             uid_base=UID_BASE, expose=(os.path.dirname(sock), *self.expose),
                             hide=self.hide)
        # the forwarder beside the agent's command; its output and the agent's (stderr
        # joined to stdout) come through the job's pipe into the log as they are written
        argv = ["/bin/sh", "-c", 'exec "$0" "$@" 2>&1', jail.interpreter(limits), "-m",
                "tsync_mcore.sandbox.forward", sock, str(PORT), self.cwd, command]
        extra = {k: v for k, v in env.items() if k not in JAIL_OWN}
        if "PATH" in env:  # after the jail's own (its python first): the venv's scripts
            extra[HOST_PATH] = env["PATH"]
        job = jail.start(argv, limits=limits, env=extra, pipes=True)
        job.stdin.close()  # the agent reads EOF, as from /dev/null
        copy = threading.Thread(target=_copy, args=(job.stdout, log_path), daemon=True)
        copy.start()
        return AgentProcess(job=job, log=(copy, log_path))


def _copy(pipe: Any, log_path: str) -> None:
    """The jailed agent's output into its log, until the jail ends."""
    with pipe, open(log_path, "ab", buffering=0) as log:
        while chunk := pipe.read1(1 << 16):
            log.write(chunk)


class AgentProcess:
    """A started agent: an unjailed process group (`proc`), or a jail's Job (`job`)."""

    def __init__(self, proc: Any = None, job: Any = None, log: Any = None) -> None:
        self.proc, self.job, self._log = proc, job, log
        self._exit: asyncio.Future | None = None  # one waiter for the job, shared

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else self.job.pid

    @property
    def returncode(self) -> int | None:
        if self.proc is not None:
            return self.proc.returncode
        if self._exit is None or not self._exit.done() or self._exit.cancelled():
            return None
        return self._exit.result()

    async def wait(self) -> int:
        if self.proc is not None:
            return await self.proc.wait()
        if self._exit is None:
            # a thread of its own: a pool worker waits for the whole run, and the loop's
            # executor (a few threads) is the endpoint's, for tokenizing requests
            loop = asyncio.get_running_loop()
            self._exit = loop.create_future()
            threading.Thread(target=self._wait_job, args=(loop, self._exit),
                             name=f"agent-{self.job.pid}", daemon=True).start()
        return await asyncio.shield(self._exit)

    def _wait_job(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        def settle(code: int | None, error: BaseException | None) -> None:
            if fut.done():
                return
            if error is None:
                fut.set_result(code)
            else:
                fut.set_exception(error)
        try:
            out = (self._end_job(), None)
        except BaseException as e:  # noqa: BLE001 — handed to the waiter
            out = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *out)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _end_job(self) -> int:
        res = self.job.wait(None)
        copy, path = self._log
        copy.join(5.0)  # the last of its output, before anyone reads the log
        if res.stderr:  # the jail's own words (it could not start the program)
            with open(path, "a") as log:
                log.write(res.stderr)
        return res.returncode if res.returncode is not None else -signal.SIGKILL

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """`sig` to the whole agent: its process group, or (SIGKILL) its jail."""
        if self.job is not None:
            if sig == signal.SIGKILL:  # the jail's teardown waits: never on the event loop
                threading.Thread(target=self.job.kill, daemon=True).start()
            else:
                try:
                    os.kill(self.job.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
