"""Agent pools (rollout.agent: openai, rollout.agent_pool: N > 0): N long-lived worker
processes of rollout.agent_command, started once and kept across batches; each pulls
trajectories from the endpoint (docs/guide/agents.md, "Agent pools"):

    worker env   TSYNC_POOL_URL=http://HOST:PORT/v1/pool, OPENAI_API_KEY, TSYNC_WORKER_ID
    POST /v1/pool/next {"worker": id, "wait_s": <= 30}
        200 {"trajectory", "base_url", "api_key", "task" (+ "tools_url")}: a trajectory
            to run, with its own key (the worker's key serves /v1/pool/next only)
        204 nothing came within wait_s (poll again);  410 the rollout is stopping (exit)
    POST /t/<id>/v1/done  {} | {"reward": x} | {"error": "why"}: the trajectory ends

The pool hands trajectories out and watches its workers: a trajectory still held
rollout.agent_timeout_s after its handout is failed ("timed out") and its worker's process
group killed (a hung worker cannot be trusted: its other held trajectories fail "crashed");
a worker that exits fails the trajectories it held ("crashed", its exit code) and is
restarted (rollout/agent_restarts). A worker that holds nothing and has not polled for
the timeout while work waits is killed as hung. Crash-loop guard: a slot whose worker ends
CRASH_LOOP times in a row without a handout, each time within FAST_EXIT_S of its start (or
without ever polling), is not restarted; with no live worker left the waiting trajectories
fail with `AgentPoolDead` (one line: the command and the last worker's log), which stops
the rollout. Logs: RUN/agent/pool/worker<k>.log, appended across restarts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tsync_mcore.rollout.openai.launch import Launcher
from tsync_mcore.rollout.openai.params import ApiError

MAX_WAIT_S = 30.0  # the longest long-poll of /v1/pool/next
FAST_EXIT_S = 5.0  # a worker ending this soon after its start, without work: a failed start
CRASH_LOOP = 3  # failed starts in a row after which a slot is not restarted
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this


# What an agent process inherits of the rollout's environment: enough to find and run a
# program and speak TLS. Nothing else (tracker keys, cloud credentials, the run's settings);
# rollout.agent_env names more to pass on.
AGENT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
             "TERM", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
             "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")


def agent_env(extra: Sequence[str] = (), **values: str) -> dict[str, str]:
    """The environment of an agent process: AGENT_ENV and `extra` as the rollout has them,
    then `values` (its endpoint, key and task)."""
    env = {k: os.environ[k] for k in (*AGENT_ENV, *extra) if k in os.environ}
    env.update(values)
    return env


class AgentPoolDead(RuntimeError):
    """No live worker is left (every slot in a crash loop): the rollout stops."""


@dataclass(eq=False)
class _Job:
    tid: str
    handout: dict[str, Any]
    handed: asyncio.Future  # -> the _Slot that took it (or AgentPoolDead)
    result: asyncio.Future  # -> (status, exit code)
    t_handout: float = 0.0


@dataclass(eq=False)
class _Slot:
    k: int
    log: str
    life: int = -1
    proc: Any = None
    t_start: float = 0.0
    last_poll: float = 0.0
    polling: int = 0
    polled: bool = False
    got_work: bool = False
    streak: int = 0  # failed starts in a row
    dead: bool = False
    held: set = field(default_factory=set)
    task: asyncio.Task | None = None

    @property
    def worker_id(self) -> str:
        return f"{self.k}-{self.life}"


class AgentPool:
    """`size` workers of `command`; `run(tid, handout, timeout_s)` queues a trajectory and
    returns (status, exit code, the worker's log) once its worker posts done, exits, or the
    timeout passes. Start with `start()` (idempotent), end with `stop()`."""

    def __init__(self, server: Any, *, command: str, size: int, run_dir: str,
                 timeout_s: float, counters: Any = None, pass_env: Sequence[str] = (),
                 isolation: str = "isolate", expose: Sequence[str] = ()) -> None:
        self.server, self.command, self.timeout_s = server, command, timeout_s
        # each worker in a jail of its own (launch.py), the run directory out of its sight
        self.launcher = Launcher(server, isolation, expose=expose, hide=(run_dir,))
        self.pass_env = tuple(pass_env)
        self.counters = counters
        self.dir = os.path.join(run_dir, "agent", "pool")
        self.slots = [_Slot(k, os.path.join(self.dir, f"worker{k}.log")) for k in range(size)]
        self.waiting: deque[_Job] = deque()
        self.pollers: deque[tuple[str, asyncio.Future]] = deque()
        self.jobs: dict[str, _Job] = {}
        self.stopping = False
        self.dead: str | None = None
        self.starts = 0  # worker processes started (first starts and restarts)
        self._watchdog: asyncio.Task | None = None
        server.pool = self

    @property
    def url(self) -> str:
        return self.launcher.pool_url()

    # --- the rollout's side -----------------------------------------------------------

    async def start(self) -> None:
        if self._watchdog is not None:
            return
        os.makedirs(self.dir, exist_ok=True)
        for slot in self.slots:
            await self._spawn(slot)
            slot.task = asyncio.ensure_future(self._watch(slot))
        self._watchdog = asyncio.ensure_future(self._idle_watchdog())

    async def run(self, tid: str, handout: dict[str, Any], timeout_s: float
                  ) -> tuple[str, int | None, str]:
        loop = asyncio.get_running_loop()
        job = _Job(tid, handout, loop.create_future(), loop.create_future())
        self.jobs[tid] = job
        try:
            if self.dead:
                raise AgentPoolDead(self.dead)
            self._offer(job)
            slot = await job.handed
            try:
                status, code = await asyncio.wait_for(asyncio.shield(job.result), timeout_s)
            except asyncio.TimeoutError:
                if job.result.done():
                    status, code = job.result.result()
                else:
                    job.result.set_result(("timed out", None))
                    status, code = "timed out", None
                    self._kill(slot, signal.SIGKILL)  # its watcher fails the rest, restarts
            return status, code, slot.log
        finally:  # done, failed, or cancelled: out of the queue and its worker's hands
            self.jobs.pop(tid, None)
            if job in self.waiting:
                self.waiting.remove(job)
            for slot in self.slots:
                slot.held.discard(job)

    def finish(self, tid: str) -> None:
        """Its worker posted done (the server has checked the body)."""
        job = self.jobs.get(tid)
        if job is not None and not job.result.done():
            job.result.set_result(("ok", None))

    async def stop(self) -> None:
        """410 to every poller, SIGTERM to every worker, SIGKILL after STOP_GRACE_S."""
        self.stopping = True
        self._fail_waiting("the rollout is stopping")
        while self.pollers:
            _, fut = self.pollers.popleft()
            if not fut.done():
                fut.set_result(None)
        tasks = [t for t in [self._watchdog] + [s.task for s in self.slots] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        live = [s for s in self.slots if s.proc is not None and s.proc.returncode is None]
        for s in live:
            self._kill(s, signal.SIGTERM)
        if live:
            await asyncio.wait([asyncio.ensure_future(s.proc.wait()) for s in live],
                               timeout=STOP_GRACE_S)
        for s in self.slots:
            if s.proc is not None:
                self._kill(s, signal.SIGKILL)  # the whole group, whatever the shell left
                await s.proc.wait()

    # --- the workers' side (POST /v1/pool/next) ---------------------------------------

    async def next(self, body: dict) -> dict | None:
        """A handout for the polling worker; None: nothing within wait_s (204)."""
        wait_s = body.get("wait_s", MAX_WAIT_S)
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or \
                not 0 <= wait_s <= MAX_WAIT_S:
            raise ApiError(400, f"wait_s must be a number in [0, {MAX_WAIT_S:g}], got "
                                f"{wait_s!r}", param="wait_s")
        worker = body.get("worker")
        slot = self._slot(worker)
        if self.stopping:
            raise ApiError(410, "the rollout is stopping: exit", kind="gone")
        if slot is None:
            raise ApiError(404, f"unknown worker {worker!r} (TSYNC_WORKER_ID of a live worker)",
                           kind="not_found_error", param="worker")
        slot.polled, slot.last_poll = True, time.monotonic()
        deadline = time.monotonic() + wait_s
        while True:
            job = self.waiting.popleft() if self.waiting else await self._poll(
                slot, worker, deadline - time.monotonic())
            if job is None:
                return None
            if not job.handed.done():  # else its trajectory was cancelled meanwhile
                break
        if self._slot(worker) is not slot:  # the worker went while it waited
            self._offer(job, front=True)
            raise ApiError(404, f"worker {worker!r} has exited", kind="not_found_error")
        job.t_handout = time.monotonic()
        slot.held.add(job)
        slot.got_work, slot.streak = True, 0
        job.handed.set_result(slot)
        return job.handout

    async def _poll(self, slot: _Slot, worker: str, wait_s: float) -> _Job | None:
        """Wait for a job offered to this worker; None: none within wait_s."""
        fut = asyncio.get_running_loop().create_future()
        self.pollers.append((worker, fut))
        slot.polling += 1
        try:
            await asyncio.wait([fut], timeout=max(wait_s, 0))
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result() is not None:
                self._offer(fut.result(), front=True)  # never lose a handout
            fut.cancel()
            raise
        finally:
            slot.polling -= 1
            slot.last_poll = time.monotonic()
        if not fut.done():
            fut.cancel()
            self.pollers = deque(p for p in self.pollers if p[1] is not fut)
            return None
        if fut.result() is None:  # stopping, or this worker is gone
            if self.stopping:
                raise ApiError(410, "the rollout is stopping: exit", kind="gone")
            raise ApiError(404, f"worker {worker!r} has exited", kind="not_found_error")
        return fut.result()

    # --- internals ---------------------------------------------------------------------

    def _slot(self, worker: Any) -> _Slot | None:
        for s in self.slots:
            if s.worker_id == worker and not s.dead and s.proc is not None and \
                    s.proc.returncode is None:
                return s
        return None

    def _offer(self, job: _Job, front: bool = False) -> None:
        """To a waiting poller of a live worker, else into the queue."""
        if job.handed.done():  # cancelled, or the pool died
            return
        while self.pollers:
            worker, fut = self.pollers.popleft()
            if fut.done():
                continue
            if self._slot(worker) is None:
                fut.set_result(None)
                continue
            fut.set_result(job)
            return
        if front:
            self.waiting.appendleft(job)
        else:
            self.waiting.append(job)

    async def _spawn(self, slot: _Slot) -> None:
        slot.life += 1
        slot.polled = slot.got_work = False
        env = agent_env(self.pass_env, TSYNC_POOL_URL=self.url,
                        OPENAI_API_KEY=self.server.new_worker_key(slot.worker_id),
                        TSYNC_WORKER_ID=slot.worker_id)
        with open(slot.log, "ab") as log:
            log.write(f"[pool] worker {slot.worker_id} starts: {self.command}\n".encode())
        slot.proc = await self.launcher.start(self.command, env, slot.log)
        slot.t_start = slot.last_poll = time.monotonic()
        self.starts += 1

    async def _watch(self, slot: _Slot) -> None:
        """Wait for the worker's exit: fail what it held, restart it (or not: crash loop)."""
        while True:
            code = await slot.proc.wait()
            self._kill(slot, signal.SIGKILL)  # anything the shell left in its group
            lived = time.monotonic() - slot.t_start
            for job in list(slot.held):
                if not job.result.done():
                    job.result.set_result(("crashed", code))
            slot.held.clear()
            self._offer_none(slot.worker_id)  # its pending polls end (404)
            if self.stopping:
                return
            failed_start = not slot.got_work and (lived < FAST_EXIT_S or not slot.polled)
            slot.streak = slot.streak + 1 if failed_start else 0
            if slot.streak >= CRASH_LOOP:
                slot.dead = True
                print(f"[rollout] agent pool worker {slot.k} ended {slot.streak} times in a "
                      f"row without work (exit code {code}); not restarted; its log: "
                      f"{slot.log}", flush=True)
                if all(s.dead for s in self.slots):
                    self._die(slot, code)
                return
            print(f"[rollout] agent pool worker {slot.worker_id} exited (code {code}) after "
                  f"{lived:.1f}s; restarting; its log: {slot.log}", flush=True)
            if self.counters is not None:
                self.counters.restarts += 1
            await asyncio.sleep(min(0.1 * 2 ** slot.streak, 2.0) if slot.streak else 0)
            await self._spawn(slot)

    def _offer_none(self, worker: str) -> None:
        keep = deque()
        for w, fut in self.pollers:
            if w == worker:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((w, fut))
        self.pollers = keep

    async def _idle_watchdog(self) -> None:
        """A worker that holds nothing and has not polled for the timeout while work waits
        is hung: killed (its watcher restarts it), so a batch never waits on it forever."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            if not self.waiting:
                continue
            now = time.monotonic()
            for s in self.slots:
                if not s.dead and s.proc is not None and s.proc.returncode is None and \
                        not s.held and not s.polling and now - s.last_poll > self.timeout_s:
                    print(f"[rollout] agent pool worker {s.worker_id} has not polled for "
                          f"{now - s.last_poll:.0f}s while work waits; killed", flush=True)
                    self._kill(s, signal.SIGKILL)

    def _die(self, slot: _Slot, code: int | None) -> None:
        last = ""
        try:
            with open(slot.log, errors="replace") as f:
                lines = [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()]
            last = next((x for x in reversed(lines) if not x.startswith("[pool]")), "")
        except OSError:
            pass
        self.dead = (f"rollout.agent_pool: every worker of `{self.command}` ended "
                     f"{CRASH_LOOP} times in a row without taking a trajectory (last exit "
                     f"code {code}); see {slot.log}" + (f" (last line: {last[:200]})"
                                                        if last else ""))
        print(f"[rollout] {self.dead}", flush=True)
        self._fail_waiting(self.dead)

    def _fail_waiting(self, why: str) -> None:
        for job in list(self.jobs.values()):
            if not job.handed.done():
                job.handed.set_exception(AgentPoolDead(why))
        self.waiting.clear()

    @staticmethod
    def _kill(slot: _Slot, sig: int) -> None:
        if slot.proc is not None:
            slot.proc.kill(sig)
