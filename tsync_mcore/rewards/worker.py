"""A jailed scorer worker: the process rewards/jailed.py starts in the jail.

The worker reads one setup frame (which scorer to build: a reasoning-gym task's, or a
`reward.function` spec), builds it once (the imports, the dataset) and answers
`{"ready": ...}` or `{"error": "<one line>"}`. Then it serves one call at a time: each call
runs in a child forked for it, so no answer can leave state for the next (the child starts
from the worker's state after setup, every time). The child sets RLIMIT_CPU, never holds
the worker's pipes (it writes its one result to a pipe of its own) and cannot trace the
worker (PR_SET_DUMPABLE 0 there); the worker kills it, and what it started, at the wall
limit.

Frames both ways (rewards/wire.py); a reply is `{"ok": {"reward": x, <extra>: y}}`
(checked by parse_result in the child, checked again on the rollout side) or
`{"error": "<one line>"}`.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import sys
import time
from typing import Any

from tsync_mcore.rewards.call import Exited, call_to_the_end, parse_result
from tsync_mcore.rewards.wire import (HEADER, MAX_REQUEST, MAX_RESULT, FrameError, decode,
                                      dump, read_frame, write_frame)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def build(setup: dict[str, Any]) -> tuple[Any, bool]:
    """(the scorer, whether it takes `messages`) from the setup frame."""
    from tsync_mcore.rewards.load import accepts, load_reward_fn

    if setup["kind"] == "reasoning_gym":
        from tsync_mcore.data.rgym import make_dataset
        from tsync_mcore.rewards.rgym import task_reward

        dataset = make_dataset(setup["task"], decode(setup["params"]), setup["seed"],
                               setup["size"])
        _warm(lambda: dataset.score_answer(answer="0", entry=dataset[0]))
        return task_reward(dataset, setup["answer_tag"], setup["answer_from"]), False
    fn = load_reward_fn(setup["spec"], source=setup.get("source"))
    if setup["spec"] == "math":
        _warm(lambda: fn(prompt="", response="\\boxed{\\frac{1}{2}}", label="0.5", meta={}))
    return fn, accepts(fn, "messages")


def _warm(call: Any) -> None:
    """One honest call in the worker itself, so what the scorer imports or builds on its
    first call is there before the fork, not redone in every call's child."""
    try:
        call()
    except Exception:  # the real calls will say what is wrong
        pass


def _result(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The child's reply: the call's (reward, extras) as parse_result checks them, or why not."""
    try:
        out = call_to_the_end(fn, kwargs)
    except Exited as e:  # sys.exit or KeyboardInterrupt from the scorer
        return {"error": f"raised {e}"}
    except Exception as e:  # the scorer's own failure
        return {"error": f"raised {type(e).__name__}: {_first_line(e)}".rstrip(": ")}
    try:
        reward, extras = parse_result(out)
    except ValueError as e:
        return {"error": str(e)}
    return {"ok": {"reward": reward, **extras}}


def _child(fn: Any, kwargs: dict[str, Any], out_fd: int, cpu_s: int,
           wire: tuple[int, ...], no_spawn: bool) -> None:
    """The forked child: one call, its reply written to `out_fd`, then _exit. It closes
    the worker's wire first (no answer can read the next request or write to the rollout) and
    sends its own stdout/stderr nowhere. `no_spawn`: RLIMIT_NPROC 0, so it can start no
    process or thread (an `os.system` in an answer runs nothing)."""
    code = 0
    try:
        for fd in wire:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.setpgid(0, 0)  # a group of its own: the worker kills it and its children at once
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        if no_spawn:
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
        reply = _result(fn, kwargs)
        try:
            data = dump(reply)
        except (TypeError, ValueError) as e:
            data = dump({"error": f"its result does not serialize: {_first_line(e)}"})
        if len(data) - HEADER.size > MAX_RESULT:
            data = dump({"error": f"its result is {len(data)} bytes (at most {MAX_RESULT})"})
        view = memoryview(data)
        while view:
            view = view[os.write(out_fd, view):]
    except BaseException:  # nothing may run on in a forked copy of the worker
        code = 70
    os._exit(code)


def _kill_call(pid: int, sweep: bool) -> None:
    """SIGKILL the call's process group; with `sweep` (the jail's own PID namespace and
    uid), every other process this uid has there too (a child that left the group). Never
    as root: kill(-1) there would reach every process of the host."""
    sweep = sweep and os.getuid() != 0 and os.geteuid() != 0
    for target in ((-1,) if sweep else ()) + (-pid,):
        try:
            os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def serve_one(fn: Any, kwargs: dict[str, Any], timeout_s: float, *, sweep: bool = False,
              no_spawn: bool = False, wire: tuple[int, ...] = ()) -> dict[str, Any]:
    """One call in a forked child, killed at `timeout_s`; the reply to send. `wire`: the
    worker's descriptors the child must not keep."""
    r, w = os.pipe()
    deadline = time.monotonic() + timeout_s
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(fn, kwargs, w, max(1, math.ceil(timeout_s)), wire, no_spawn)
    os.close(w)
    try:
        try:
            data = read_frame(r, MAX_RESULT, deadline)
        except TimeoutError:
            _kill_call(pid, sweep)
            os.waitpid(pid, 0)
            return {"error": f"timed out after {timeout_s:g}s (reward.timeout_s): killed"}
        except FrameError as e:
            data = {"error": f"its reply was refused: {e}"}
    finally:
        os.close(r)
    _kill_call(pid, sweep)  # what the call started and left behind
    _, status = os.waitpid(pid, 0)
    if data is not None:
        return data
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return {"error": f"used its {max(1, math.ceil(timeout_s))} CPU seconds "
                             f"(reward.timeout_s): killed"}
        return {"error": f"died of signal {sig} ({signal.Signals(sig).name})"}
    return {"error": f"exited with status {os.WEXITSTATUS(status)} without a result"}


def _no_dump() -> None:
    """PR_SET_DUMPABLE 0: no process of this uid may ptrace the worker or read its memory
    or descriptors through /proc (its children inherit the flag)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE


def main() -> None:
    # The wire keeps fds of its own; 0 and 1 become /dev/null and stderr, so a scorer that
    # prints (or reads) never touches the frames.
    wire_in, wire_out = os.dup(0), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)
    _no_dump()
    try:
        setup = read_frame(wire_in, MAX_REQUEST)
        if setup is None:
            return
        fn, takes_messages = build(setup)
    except BaseException as e:  # one line back to the rollout, which refuses to start
        known = type(e).__name__ in ("RewardError", "DataError")  # already one line
        write_frame(wire_out, {"error": _first_line(e) if known else
                               f"{type(e).__name__}: {_first_line(e)}"})
        return
    write_frame(wire_out, {"ready": True, "takes_messages": takes_messages})
    # Built-in and reasoning-gym scorers start no process; a user's function may (in here)
    timeout_s, sweep = float(setup["timeout_s"]), bool(setup.get("sweep"))
    no_spawn = setup["kind"] == "reasoning_gym" or setup.get("spec") == "math"
    while True:
        try:
            req = read_frame(wire_in, MAX_REQUEST)
        except FrameError as e:
            print(f"[scorer worker] {e}; exiting", file=sys.stderr, flush=True)
            return
        if req is None:  # the rollout closed the pipe: done
            return
        write_frame(wire_out, serve_one(fn, decode(req), timeout_s, sweep=sweep,
                                        no_spawn=no_spawn, wire=(wire_in, wire_out.fileno())))


if __name__ == "__main__":
    main()
