"""Scorers that read model output, run in a pool of jailed workers (`reward.isolation`).

A reasoning-gym task's scorer (several `eval` the answer), `math` (sympy parses it) and a
user's `reward.function` never run in the rollout process: each worker is a
`python -I` process started in the jail (tsync_mcore/sandbox/jail.py: a uid of its own,
never root, no network, seccomp, the system read-only), running rewards/worker.py. It
builds the scorer once; each call is a child it forks, with RLIMIT_CPU, killed at
`reward.timeout_s`. The rollout side waits for the reply in a thread (the event loop goes
on), parses it strictly, and kills the whole worker when even the reply does not come; a
worker that dies mid-call makes that call this trajectory's error and is started again for
the next. A reward file's text is read here and handed over (the jailed uid need not be
able to read the file; what it imports must be importable there). Whatever cannot be
jailed (a scorer that does not build there, a task whose entries do not travel as JSON)
is refused at start in one line. `reward.isolation: none` keeps today's in-process calls
(for trusted scorers that need the network or a GPU); `exact_match` (a string compare) and
`code_tests` (its own sandbox per test) always run in-process.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tsync_mcore.rewards import wire
from tsync_mcore.rewards.load import RewardError, check_spec, load_reward_fn, read_source
from tsync_mcore.sandbox import jail

IN_PROCESS = ("exact_match", "code_tests")  # a string compare; a sandbox of its own
START_TIMEOUT_S = 120.0  # a worker's imports and setup (reasoning-gym: about a second)
REPLY_GRACE_S = 5.0  # past reward.timeout_s: the worker's own kill, then ours
# The worker runs the rollout's own tsync_mcore (a worktree, an editable install): its
# source root first on sys.path, then the paths a user's reward module is found on.
_BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
         "from tsync_mcore.rewards.worker import main; main()")


class ScorerFailed(RuntimeError):
    """One jailed call failed (this trajectory's error); the message is one line."""


class _Worker:
    def __init__(self, job: Any, takes_messages: bool) -> None:
        self.job, self.takes_messages = job, takes_messages
        self.out_fd = job.stdout.fileno()


class ScorerPool:
    """Up to `workers` jailed workers serving one scorer (`setup`: worker.build's frame)."""

    def __init__(self, setup: dict[str, Any], *, what: str, limits: jail.Limits,
                 workers: int, timeout_s: float, paths: list[str]) -> None:
        self.what, self.limits, self.workers, self.timeout_s = what, limits, workers, timeout_s
        # kill(-1) after each call is safe only for a uid of the worker's own in a PID
        # namespace of its own (the worker also checks it is not root)
        sweep = (os.geteuid() == 0 and bool(limits.user) and bool(limits.uid_base)
                 and limits.isolation != "none" and not jail.fs_isolation())
        self.setup = {**setup, "timeout_s": timeout_s, "sweep": sweep}
        self.argv = [jail.interpreter(limits), "-I", "-c", _BOOT, json.dumps(paths)]
        self.takes_messages = False
        self.started = 0  # workers started, restarts included
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()  # started and not ended: what close() kills
        self._lock = threading.Lock()
        self._slots: asyncio.Semaphore | None = None
        atexit.register(self.close)

    def start(self) -> None:
        """The first worker, now: a scorer that cannot be built in the jail stops the run
        here, in one line."""
        try:
            w = self._spawn()
        except (ScorerFailed, jail.SandboxError) as e:
            raise RewardError(f"{self.what} cannot run in the jail (reward.isolation: "
                              f"{self.limits.isolation}): {e}; reward.isolation: none scores "
                              f"in-process (trusted scorers only)") from None
        self.takes_messages = w.takes_messages
        self._keep(w)

    def _spawn(self) -> _Worker:
        job = jail.start(self.argv, limits=self.limits, env={"OMP_NUM_THREADS": "1"},
                         pipes=True)
        self.started += 1
        try:
            job.stdin.write(wire.dump(wire.encode(self.setup)))
            job.stdin.flush()
            reply = wire.read_frame(job.stdout.fileno(), wire.MAX_RESULT,
                                    time.monotonic() + START_TIMEOUT_S)
        except TimeoutError:
            job.kill()
            raise ScorerFailed(f"the worker did not start within {START_TIMEOUT_S:g}s") from None
        except (OSError, wire.FrameError) as e:
            raise ScorerFailed(f"the worker's setup failed: {e} ({_ended(job)})") from None
        if not isinstance(reply, dict) or reply.get("ready") is not True:
            why = reply.get("error") if isinstance(reply, dict) else None
            if reply is None:
                why = f"the worker exited before it was ready ({_ended(job)})"
            job.kill()
            raise ScorerFailed(str(why or f"the worker's setup reply {str(reply)[:80]!r}"))
        w = _Worker(job, bool(reply.get("takes_messages")))
        with self._lock:
            self._all.add(w)
        return w

    def _keep(self, w: _Worker) -> None:
        with self._lock:
            self._idle.append(w)

    def _drop(self, w: _Worker) -> None:
        with self._lock:
            self._all.discard(w)

    def _call_blocking(self, w: _Worker | None, request: bytes) -> Any:
        """One request on a worker (started first when there is none): its reply. The
        worker goes back to the pool here, so a cancelled caller loses none. Runs in a
        thread."""
        if w is None:
            w = self._spawn()
        try:
            w.job.stdin.write(request)
            w.job.stdin.flush()
            reply = wire.read_frame(w.out_fd, wire.MAX_RESULT,
                                    time.monotonic() + self.timeout_s + REPLY_GRACE_S)
        except TimeoutError:
            w.job.kill()
            reply = {"error": f"timed out after {self.timeout_s:g}s (reward.timeout_s): the "
                              f"worker was killed"}
        except (OSError, wire.FrameError) as e:
            reply = {"error": f"the scorer worker failed mid-call: {e} ({_ended(w.job)})"}
        else:
            if reply is not None:
                self._keep(w)
                return reply
            reply = {"error": f"the scorer worker died mid-call ({_ended(w.job)})"}
        self._drop(w)
        return reply

    async def call(self, kwargs: dict[str, Any]) -> dict[str, float]:
        """The scorer's result ({"reward": x, extras}) for one call; ScorerFailed (one
        line) for anything else. reward.timeout_s runs from the moment a worker has it."""
        try:
            request = wire.dump(wire.encode(kwargs))
        except (TypeError, ValueError) as e:
            raise ScorerFailed(f"its arguments cannot go to the jailed scorer: {e} does not "
                               f"serialize as JSON") from None
        if len(request) - 4 > wire.MAX_REQUEST:
            raise ScorerFailed(f"its arguments are {len(request)} bytes (at most "
                               f"{wire.MAX_REQUEST} go to the jailed scorer)")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            with self._lock:
                w = self._idle.pop() if self._idle else None
            try:
                reply = await jail.in_thread(self._call_blocking, w, request)
            except (ScorerFailed, jail.SandboxError, OSError) as e:  # a restart that failed
                raise ScorerFailed(f"its scorer worker could not be started: {e}") from None
        return _strict(reply)

    def close(self) -> None:
        """Every worker ended: at end of input (all told first, then waited for), or killed
        when it does not end within a second (a busy one)."""
        with self._lock:
            workers, self._idle, self._all = list(self._all), [], set()
        for w in workers:
            try:
                w.job.stdin.close()
            except OSError:
                pass
        for w in workers:
            w.job.wait(1.0)


def _strict(reply: Any) -> dict[str, float]:
    """The worker's reply, as the rollout accepts it: {"ok": {"reward": x, ...}} or
    {"error": "<one line>"}; parse_result checks the numbers again."""
    if isinstance(reply, dict) and set(reply) == {"ok"} and isinstance(reply["ok"], dict):
        return reply["ok"]
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        raise ScorerFailed(" ".join(reply["error"].split())[:400])
    raise ScorerFailed(f"the scorer worker's reply is malformed: {str(reply)[:80]!r}")


def _ended(job: Any) -> str:
    """How a worker that stopped answering ended (killed now if it still runs), with the
    last line it wrote to stderr."""
    r = job.wait(2.0)
    how = ("still running: killed" if r.timed_out else f"exit status {r.returncode}"
           if r.returncode >= 0 else f"killed by signal {-r.returncode}")
    last = (r.stderr.strip().splitlines() or [""])[-1][:200]
    return f"{how}; its stderr: {last}" if last else how


# --- which scorer runs where --------------------------------------------------------------

def scorer_limits(reward_cfg: Any, expose: tuple[str, ...] = ()) -> jail.Limits:
    """The jail of a scorer worker, from RewardConfig. `expose`: host paths it reads (a
    reward file's directory, under the jail's private /tmp perhaps), where it has a view."""
    c = reward_cfg
    if jail.fs_isolation():  # no mount namespace: the host's paths are seen as they are
        expose = ()
    return jail.Limits(timeout_s=c.timeout_s, memory_mb=c.scorer_memory_mb, nproc=64,
                       nofile=256, user=c.sandbox_user, network=c.isolation,
                       isolation=c.isolation, cpu_s=1 << 30, uid_base=1 << 24,
                       expose=expose)


def _source_root() -> str:
    import tsync_mcore
    return os.path.dirname(os.path.dirname(os.path.abspath(tsync_mcore.__file__)))


def _user_paths() -> list[str]:
    """The rollout's import paths outside the interpreter's own (PYTHONPATH, the working
    directory): where a `package.module:name` reward is found."""
    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    out = []
    for p in sys.path:
        real = os.path.realpath(p or ".")
        if os.path.isdir(real) and not any(real == o or real.startswith(o + os.sep)
                                           for o in own):
            out.append(real)
    return list(dict.fromkeys(out))


def reward_scorer(spec: str, reward_cfg: Any) -> Callable[..., Any] | ScorerPool:
    """reward.function's scorer: in-process for exact_match, code_tests and
    `reward.isolation: none`, else a started ScorerPool. RewardError (one line) when it
    cannot be used."""
    if reward_cfg.isolation == "none" or spec in IN_PROCESS:
        return load_reward_fn(spec, reward_cfg)
    try:
        check_spec(spec)
    except ValueError as e:
        raise RewardError(f"reward.function {e}") from None
    if spec == "judge":
        return load_reward_fn(spec, reward_cfg)  # its one-line refusal
    where, colon, name = spec.rpartition(":")
    paths = [_source_root(), *_user_paths()]
    setup: dict[str, Any] = {"kind": "function", "spec": spec}
    if colon and where.endswith(".py"):  # its text goes along: the jail may not see the file
        path = os.path.abspath(where)
        setup = {"kind": "function", "spec": f"{path}:{name}", "source": read_source(spec, path)}
    expose = tuple(p for p in paths if not p.startswith("/root" + os.sep))
    pool = ScorerPool(setup, what=f"reward.function {spec!r}",
                      limits=scorer_limits(reward_cfg, expose),
                      workers=reward_cfg.workers, timeout_s=reward_cfg.timeout_s, paths=paths)
    pool.start()
    return pool


def task_scorer(task: str, rc: Any, reward_cfg: Any, sets: list[Any]) -> Callable[..., Any] | ScorerPool:
    """rollout.env reasoning_gym:<task>: the task's scorer, in a started ScorerPool (the
    dataset rebuilt there from the same config), or in-process under reward.isolation
    none. `sets`: the generated TaskSets, whose entries must travel as JSON."""
    from tsync_mcore.rewards.rgym import task_reward

    if reward_cfg.isolation == "none":
        return task_reward(sets[0].dataset, rc.answer_tag, rc.answer_from)
    what = f"reasoning_gym:{task} scorer"
    for ts in sets:
        for i, entry in enumerate(ts.entries):
            try:
                wire.encode(entry)
            except TypeError as e:
                raise RewardError(f"{what}: {ts.path} entry {i} holds {e}, which cannot go to "
                                  f"the jailed scorer as JSON; set reward.isolation: none to "
                                  f"score in-process") from None
    setup = {"kind": "reasoning_gym", "task": task, "params": wire.encode(rc.params),
             "seed": rc.train_seed, "size": rc.train_size, "answer_tag": rc.answer_tag,
             "answer_from": rc.answer_from}
    root = _source_root()
    pool = ScorerPool(setup, what=what, limits=scorer_limits(reward_cfg, (root,)),
                      workers=reward_cfg.workers, timeout_s=reward_cfg.timeout_s, paths=[root])
    pool.start()
    return pool
