"""`reward.function` → a callable, checked before the run starts.

Specs: a built-in name (`exact_match`, `math`, `code_tests`; `judge` is served by the
rollout's judge engine, tsync_mcore/rewards/judge.py), `path/to/file.py:name`
(relative paths from the working directory) or `package.module:name` (importable).
Every way a spec can be wrong is one line naming the spec and the problem.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from tsync_mcore.util.safe_files import BadFile

BUILTINS = ("exact_match", "math", "code_tests", "judge")  # judge: rewards/judge.py
MAX_SOURCE = 4 << 20  # bytes of a reward file
ARGS = ("prompt", "response", "label", "meta")  # always passed; `messages` too for multi-turn
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class RewardError(BadFile):
    """reward.function cannot be used; the message names the spec and why."""


def check_spec(spec: str) -> None:
    """The spec's syntax (ValueError); nothing is imported."""
    if spec in BUILTINS:
        return
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name:
        raise ValueError(f"{spec!r} is neither a built-in ({', '.join(BUILTINS)}) nor "
                         f"'path/to/file.py:name' or 'package.module:name'")
    if not name.isidentifier():
        raise ValueError(f"{spec!r}: {name!r} is not a Python name")
    if not where.endswith(".py") and not _DOTTED.match(where):
        raise ValueError(f"{spec!r}: {where!r} is neither a .py file nor a dotted module name")


def read_source(spec: str, path: str) -> str:
    """The text of a reward file (handed to a jailed scorer, which may not see the file)."""
    if not os.path.isfile(path):
        raise RewardError(f"reward.function {spec!r}: no file {path}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SOURCE + 1)
        if len(data) > MAX_SOURCE:
            raise RewardError(f"reward.function {spec!r}: {path} is over {MAX_SOURCE} bytes")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RewardError(f"reward.function {spec!r}: cannot read {path}: {e}") from None


def _import_file(spec: str, path: str, source: str | None = None):
    """The module of a reward file; from `source` (its text, read elsewhere) when given."""
    if source is None and not os.path.isfile(path):
        raise RewardError(f"reward.function {spec!r}: no file {path}")
    real = os.path.realpath(path) if source is None else os.path.abspath(path)
    mod_name = "tsync_reward_" + hashlib.sha1(real.encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    loader_spec = importlib.util.spec_from_file_location(mod_name, real)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module  # dataclasses/pickle in the file look themselves up here
    try:
        if source is None:
            loader_spec.loader.exec_module(module)
        else:
            exec(compile(source, real, "exec"), module.__dict__)
    except BaseException as e:  # its import ran user code: one line, never a traceback
        del sys.modules[mod_name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RewardError(f"reward.function {spec!r}: importing {path} failed: "
                          f"{type(e).__name__}: {_first_line(e)}") from None
    return module


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def accepts(fn: Callable, name: str) -> bool:
    """Whether `fn` takes keyword argument `name` (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True  # a builtin or C callable: cannot tell, let the call say
    return any(p.kind == p.VAR_KEYWORD or (p.name == name and p.kind in
               (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) for p in params)


def load_reward_fn(spec: str, reward_cfg: Any = None, source: str | None = None
                   ) -> Callable[..., Any]:
    """The callable `spec` names, checked to accept the documented keyword arguments.
    `reward_cfg` (RewardConfig) configures the built-ins (sandbox limits); `source`: a
    reward file's text, read by the caller (a jailed scorer need not see the file)."""
    try:
        check_spec(spec)
    except ValueError as e:
        raise RewardError(f"reward.function {e}") from None
    if spec == "judge":
        raise RewardError("reward.function 'judge' is no function: the rollout grades with "
                          "its judge engine (reward.judge.model_dir, rewards/judge.py)")
    if spec in BUILTINS:
        from tsync_mcore.rewards import builtins
        from tsync_mcore.rewards.sandbox import SandboxError
        try:
            return builtins.make(spec, reward_cfg)
        except (SandboxError, ImportError) as e:
            raise RewardError(f"reward.function {spec!r}: {_first_line(e)}") from None
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        module = _import_file(spec, where, source)
        place = where
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise RewardError(f"reward.function {spec!r}: no module {e.name!r} "
                              f"(is it installed, or on PYTHONPATH?)") from None
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            raise RewardError(f"reward.function {spec!r}: importing {where} failed: "
                              f"{type(e).__name__}: {_first_line(e)}") from None
        place = f"module {where}"
    if not hasattr(module, name):
        names = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_"))[:10]
        raise RewardError(f"reward.function {spec!r}: {place} defines no {name!r} "
                          f"(callables there: {names})")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"reward.function {spec!r}: {name} is a {type(fn).__name__}, "
                          f"not callable")
    missing = [a for a in ARGS if not accepts(fn, a)]
    if missing:
        raise RewardError(f"reward.function {spec!r}: {name} must accept the keyword "
                          f"arguments {', '.join(ARGS)} (or **kwargs); it lacks "
                          f"{', '.join(missing)}")
    return fn
