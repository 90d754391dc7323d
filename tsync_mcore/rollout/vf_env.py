"""`rollout.env: verifiers:<module>`: a verifiers environment (Prime Intellect's `verifiers`,
its classic API: `vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.Rubric`, as `prime env`
packages are written) run unmodified.

The rollout loads the environment once (`<module>.load_environment(**verifiers.args)`) for
its dataset: row i of `env.get_dataset()` (`get_eval_dataset()` for evaluation) is the
dataset env's row i, so groups, data positions and resume are the dataset env's. Each
trajectory's agent (tsync_mcore.rollout.openai.agents.verifiers) loads the same environment,
runs the env's own rollout on that row against the endpoint and scores it with the env's
rubric (`score`), then posts the reward, or the reason there is none (`reward_error`), which
`VerifiersTask.reward_error` turns into reward.on_error's outcome.

Everything the module does is untrusted: an import or load that fails, a module without
`load_environment`, something that is not an environment, a rubric with group reward
functions, a bad row — each is one line naming `verifiers:<module>` (and the row).
"""

from __future__ import annotations

import inspect
import math
import numbers
import signal
import threading
from typing import Any

from tsync_mcore.data.load import DataError, Row, check_prompt
from tsync_mcore.rewards import RewardFailed, RewardResult

VERIFIERS_PIN = "verifiers==0.3.1"  # the version whose classic API this runs (Makefile)
ROW_KEYS = ("prompt", "answer")  # the rest of a row is its meta (info, task, example_id, ...)


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_env(module: str, args: dict[str, Any]) -> Any:
    """`module.load_environment(**args)`, checked; every failure is a DataError in one line."""
    import importlib

    where = f"rollout.env verifiers:{module}"
    try:
        import verifiers as vf
        env_class = vf.Environment
    except Exception as e:
        raise DataError(f"{where}: the verifiers package is not usable ({_first_line(e)}); "
                        f"`make setup` installs {VERIFIERS_PIN}") from None
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise DataError(f"{where}: no module named {module!r} (install the environment's "
                            f"package, e.g. `prime env install`, or put it on PYTHONPATH)"
                            ) from None
        raise DataError(f"{where}: importing it failed: {_first_line(e)}") from None
    except BaseException as e:  # its top-level code: anything, sys.exit included
        raise DataError(f"{where}: importing it failed: {_first_line(e)}") from None
    fn = getattr(mod, "load_environment", None)
    if not callable(fn):
        raise DataError(f"{where}: the module has no load_environment() (a verifiers "
                        f"environment module defines load_environment(**kwargs) -> vf.Environment)")
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        raise DataError(f"config key 'verifiers.args': {module}.load_environment does not "
                        f"take {sorted(args)}: {e}") from None
    except ValueError:  # no signature to check (a builtin): the call says
        pass
    # verifiers' Environment installs SIGINT/SIGTERM handlers (SIGTERM: exit(143) from
    # wherever the main thread is); the process keeps its own
    saved = ({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
             if threading.current_thread() is threading.main_thread() else {})
    try:
        env = fn(**args)
    except BaseException as e:
        raise DataError(f"{where}: load_environment(**{args!r}) raised {_first_line(e)}"
                        ) from None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if not isinstance(env, env_class):
        raise DataError(f"{where}: load_environment returned {type(env).__name__}, not a "
                        f"verifiers Environment")
    if env.rubric.has_group_rewards:
        raise DataError(f"{where}: its rubric has group reward functions, which score a whole "
                        f"group in one process; here each trajectory is its own agent's")
    return env


def _dataset(env: Any, split: str, where: str) -> Any:
    try:
        if split == "train":
            return env.get_dataset()
        return env.build_eval_dataset()  # None: no evaluation set (no fallback to training's)
    except BaseException as e:
        raise DataError(f"{where}: building its {split} dataset raised {_first_line(e)}"
                        ) from None


def prompt_messages(prompt: Any) -> Any:
    """The row's prompt as plain {role, content} messages (Arrow gives every message each
    key any message has, as None)."""
    if isinstance(prompt, list):
        return [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict)
                else m for m in prompt]
    return prompt


class VerifiersSet:
    """The environment's train or eval dataset with PromptSet's interface (`path`, `len`,
    `row(i)`): the prompt (chat messages, the env's system prompt included) and the answer
    as the label; the other columns as meta."""

    def __init__(self, module: str, env: Any, split: str) -> None:
        self.module, self.split = module, split
        self.path = f"verifiers:{module} {split} dataset"
        ds = _dataset(env, split, f"rollout.env verifiers:{module}")
        self.ds = ds
        if ds is not None and len(ds) == 0:
            raise DataError(f"{self.path}: no rows")

    def __len__(self) -> int:
        return len(self.ds)

    def row(self, i: int) -> Row:
        try:
            r = dict(self.ds[int(i)])
        except Exception as e:
            raise DataError(f"{self.path} row {i}: reading it raised {_first_line(e)}") from None
        prompt = prompt_messages(r.get("prompt"))
        why = check_prompt(prompt)
        if why:
            raise DataError(f"{self.path} row {i}: prompt: {why}")
        return Row(index=int(i), prompt=prompt, label=r.get("answer"),
                   meta={k: v for k, v in r.items() if k not in ROW_KEYS})


def number(v: Any) -> float | None:
    """A finite real number (bools count 0/1), or None."""
    if not isinstance(v, numbers.Real):
        return None
    x = float(v)
    return x if math.isfinite(x) else None


class VerifiersTask:
    """A trajectory's task on the rollout side: the row its agent runs, and its reward
    outcome (`result`, as the dataset env's, for reward/errors). The agent scores; here a
    missing or failed score becomes reward.on_error's outcome."""

    def __init__(self, module: str, row: Row, where: str, on_error: str) -> None:
        self.module, self.row, self.where, self.on_error = module, row, where, on_error
        self.result: RewardResult | None = None

    def reward_error(self, why: str) -> float:
        """The agent could not score the rollout: raise (on_error: fail) or 0, counted."""
        msg = f"verifiers:{self.module} rubric on {self.where}: {why}"
        if self.on_error == "fail":
            raise RewardFailed(msg)
        self.result = RewardResult(0.0, {}, msg)
        return 0.0

    # the task's reward when the agent exited 0 without posting one (a custom command)
    def reset(self, seed: int) -> list[int]:
        self.result = None
        return []

    async def step(self, action_ids: list[int]) -> tuple[list[int], bool]:
        self.reward_error("its agent posted no reward (the verifiers agent posts the "
                          "rubric's score)")
        return [], True

    def reward(self) -> float:
        return self.result.reward if self.result is not None else 0.0


# --- the agent's side --------------------------------------------------------------------

class ScoreError(Exception):
    """The rubric could not score a rollout; the message is one line."""


def _rubrics(rubric: Any) -> list[Any]:
    """The rubric and every rubric inside it (RubricGroup nests them)."""
    out = [rubric]
    for r in getattr(rubric, "rubrics", None) or []:
        out.extend(_rubrics(r))
    return out


def guard_rubric(rubric: Any) -> list[str]:
    """Wrap each reward function of `rubric` so that a raise or a non-number is recorded
    (verifiers' Rubric logs either and scores it 0, which would train on a silent zero).
    Returns the list the failures are appended to; clear it before each scoring."""
    import functools

    errors: list[str] = []

    def guard(fn: Any) -> Any:
        name = getattr(fn, "__name__", repr(fn))

        @functools.wraps(fn)  # keeps the signature verifiers inspects for arguments
        async def wrapped(*a: Any, **kw: Any) -> Any:
            try:
                out = fn(*a, **kw)
                if inspect.isawaitable(out):
                    out = await out
            except BaseException as e:  # the env's code: anything, sys.exit included
                errors.append(f"reward function {name} raised {_first_line(e)}")
                raise RuntimeError(name) from None
            if number(out) is None:
                errors.append(f"reward function {name} returned {type(out).__name__} "
                              f"{str(out)[:60]!r}, not a finite number")
                return 0.0
            return out

        wrapped.__tsync_guarded__ = True
        return wrapped

    for r in _rubrics(rubric):
        r.funcs = [f if getattr(f, "__tsync_guarded__", False) else guard(f) for f in r.funcs]
    return errors


async def score(env: Any, state: Any, errors: list[str]) -> tuple[float, dict[str, float]]:
    """The rubric's score of a finished rollout (`state`): (reward, its functions'
    values). A function that raised or returned a non-number, or a total that is not a
    finite number, is a ScoreError."""
    errors.clear()
    try:
        await env.rubric.score_rollout(state)
    except BaseException as e:
        raise ScoreError(errors[0] if errors else f"scoring raised {_first_line(e)}") from None
    if errors:
        raise ScoreError(errors[0])
    reward = number(state.get("reward"))
    if reward is None or abs(reward) > 1e6:  # the endpoint takes |reward| <= 1e6
        raise ScoreError(f"the rubric's reward is {state.get('reward')!r}, not a finite "
                         f"number with |reward| <= 1e6")
    metrics = {str(k): x for k, v in (state.get("metrics") or {}).items()
               if (x := number(v)) is not None}
    return reward, metrics
