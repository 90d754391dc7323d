"""Calling the reward function for one trajectory, and what comes back.

The function is called with keyword arguments `prompt` (the row's prompt: text or chat
messages), `response` (the decoded answer), `label` (the row's ground truth), `meta` (the
row's other columns), and `messages` (the whole conversation) for multi-turn envs, when it
accepts it. It returns a number, or a mapping with `reward` and named numeric extras
(logged as `reward/<name>` means).

A scorer that reads model output (a reasoning-gym task's, `math`, a user's function) runs
by default in a pool of jailed workers (rewards/jailed.py, `reward.isolation`): the call
is a request to a worker, killed at `reward.timeout_s`. In-process (`exact_match`,
`reward.isolation: none`), every call runs in a worker thread — an async function on an
event loop of its own there — so a slow one, or an async one that blocks (a `time.sleep`
in an `async def`), never stalls generation, and `reward.timeout_s` bounds it.

Every failure — an exception (`sys.exit` and `KeyboardInterrupt` from the function
included), `reward.timeout_s` passing, a result that is not a finite number — is one line
naming the trajectory and row. `reward.on_error: fail` raises it
(`RewardFailed`: the rollout stops with it), `zero` scores the trajectory 0 and counts it
(`reward/errors`). A timed-out in-process sync call's thread cannot be killed (Python has
no way to): it runs on by itself (a daemon thread, so it never holds up the process's exit) while the
batch goes on without it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tsync_mcore.rewards.jailed import ScorerFailed, ScorerPool
from tsync_mcore.rewards.load import accepts

MAX_EXTRAS = 32  # named extras per result: a mapping is not a place for per-token data


class RewardFailed(RuntimeError):
    """A reward call failed under reward.on_error: fail; the message is one line."""


@dataclass
class RewardResult:
    reward: float
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the call failed (the reward is then 0)


def parse_result(out: Any) -> tuple[float, dict[str, float]]:
    """(reward, extras) from what the function returned; ValueError says what is wrong."""
    extras: dict[str, float] = {}
    if isinstance(out, dict):
        if "reward" not in out:
            raise ValueError(f"returned a mapping without 'reward' (keys: "
                             f"{sorted(map(str, out))[:10]})")
        if len(out) - 1 > MAX_EXTRAS:
            raise ValueError(f"returned {len(out) - 1} extras (at most {MAX_EXTRAS})")
        for k, v in out.items():
            if k == "reward":
                continue
            if not isinstance(k, str) or not k or "/" in k:
                raise ValueError(f"extra name {k!r} must be a non-empty string without '/'")
            extras[k] = _number(v, f"extra {k!r}")
        out = out["reward"]
    return _number(out, "reward"), extras


def _number(v: Any, what: str) -> float:
    if not isinstance(v, numbers.Real):  # bool, int, float, numpy scalars
        raise ValueError(f"{what} is {type(v).__name__} {str(v)[:60]!r}, not a number")
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(f"{what} is {x}, not finite")
    return x


class RewardRunner:
    def __init__(self, fn: Callable[..., Any], *, spec: str, timeout_s: float,
                 on_error: str = "fail", max_workers: int = 16) -> None:
        self.fn, self.spec, self.timeout_s, self.on_error = fn, spec, timeout_s, on_error
        self.takes_messages = (fn.takes_messages if isinstance(fn, ScorerPool) else
                               accepts(fn, "messages"))
        self.max_workers = max_workers
        self._slots: asyncio.Semaphore | None = None  # sync calls awaited at once

    async def score(self, where: str, *, prompt: Any, response: str, label: Any,
                    meta: dict[str, Any], messages: list[dict] | None = None,
                    traj_id: str | None = None) -> RewardResult:
        """One call; `where` names the trajectory and row in errors (`traj_id`: for runners
        that keep records, as JudgeRunner does; unused here)."""
        kwargs = dict(prompt=prompt, response=response, label=label, meta=meta)
        if messages is not None and self.takes_messages:
            kwargs["messages"] = messages
        try:
            if isinstance(self.fn, ScorerPool):  # its own deadline, enforced by killing
                out = await self.fn.call(kwargs)
            else:
                out = await asyncio.wait_for(self._call(kwargs), self.timeout_s)
            reward, extras = parse_result(out)
            return RewardResult(reward, extras)
        except ScorerFailed as e:
            why = str(e)
        except asyncio.TimeoutError:
            why = f"timed out after {self.timeout_s:g}s (reward.timeout_s)"
        except ValueError as e:
            why = str(e)
        except Exited as e:
            why = f"raised {e}"
        except Exception as e:  # the user's code: any exception is this trajectory's error
            why = f"raised {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        msg = f"reward function {self.spec} on {where}: {why}"
        if self.on_error == "fail":
            raise RewardFailed(msg)
        return RewardResult(0.0, {}, msg)

    async def _call(self, kwargs: dict[str, Any]) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_workers)
        async with self._slots:  # released on timeout too: a hung call keeps only its thread
            return await _in_daemon_thread(functools.partial(call_to_the_end, self.fn, kwargs))


class Exited(Exception):
    """The reward function called sys.exit or raised KeyboardInterrupt: asyncio would carry
    either out of the rollout's event loop, so it comes back as this trajectory's error."""


def call_to_the_end(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """`fn(**kwargs)`, and what it hands back awaited on this thread's own event loop (an
    async function, or a sync one returning an awaitable)."""
    try:
        out = fn(**kwargs)
        if inspect.isawaitable(out):
            async def wait() -> Any:
                return await out
            out = asyncio.run(wait())
    except (SystemExit, KeyboardInterrupt) as e:
        raise Exited(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                      .rstrip(": ")) from None
    return out


async def _in_daemon_thread(call: Callable[[], Any]) -> Any:
    """`call()` in a new daemon thread. Not a ThreadPoolExecutor: its workers are joined at
    interpreter exit, so one reward call that never returns would hang the rollout's exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():  # cancelled by a timeout meanwhile: nobody is waiting
            (fut.set_result if ok else fut.set_exception)(value)

    def target() -> None:
        try:
            result: tuple[bool, Any] = (True, call())
        except BaseException as e:  # handed to the awaiting coroutine
            result = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop closed while this call was running
            pass

    threading.Thread(target=target, name="reward", daemon=True).start()
    return await fut


class RewardStats:
    """Rollout-side reward metrics of one batch (or one evaluation)."""

    def __init__(self) -> None:
        self.n = 0
        self.errors = 0
        self.first_error: str | None = None
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, res: RewardResult) -> None:
        self.n += 1
        if res.error is not None:
            self.errors += 1
            self.first_error = self.first_error or res.error
        for k, v in res.extras.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
            self._counts[k] = self._counts.get(k, 0) + 1

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        out: dict[str, float] = {f"{prefix}/errors": self.errors}
        for k in sorted(self._sums):
            out[f"{prefix}/{k}"] = self._sums[k] / self._counts[k]
        return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, as verl computes it):
    1 − C(n−c, k) / C(n, k), as a product to stay finite for large n."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def eval_metrics(rewards_by_prompt: Sequence[Sequence[float]], n: int,
                 threshold: float = 1.0) -> dict[str, float]:
    """eval/reward_mean over every sample, and eval/pass@k for k = 1, 2, 4, .. ≤ n (a sample
    is correct when its reward ≥ `threshold`), averaged over prompts."""
    flat = [r for rs in rewards_by_prompt for r in rs]
    out: dict[str, float | None] = {"eval/reward_mean": sum(flat) / len(flat) if flat else None,
                             "eval/n_prompts": len(rewards_by_prompt), "eval/n_samples": n}
    k = 1
    while k <= n:
        vals = [pass_at_k(len(rs), sum(1 for r in rs if r >= threshold), k)
                for rs in rewards_by_prompt if len(rs) >= k]
        if vals:
            out[f"eval/pass@{k}"] = sum(vals) / len(vals)
        k *= 2
    return out
