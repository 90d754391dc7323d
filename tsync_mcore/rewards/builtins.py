"""Built-in reward functions: `exact_match`, `math`, `code_tests`.

All take the documented keyword arguments (prompt, response, label, meta) and return a
float in [0, 1]; `code_tests` returns the fraction of tests passed plus `all_passed`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tsync_mcore.rewards.sandbox import SandboxLimits, interpreter, run_python
from tsync_mcore.sandbox import verdict
from tsync_mcore.sandbox.jail import run_python as run_jailed


def _norm(s: Any) -> str:
    return " ".join(str(s).split())


def exact_match(*, response: str, label: Any, **_: Any) -> float:
    """1.0 when the response equals the label (or one of a list of labels) after trimming
    and collapsing whitespace, else 0.0."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    got = _norm(response)
    return float(any(got == _norm(x) for x in labels if x is not None))


def math_answer(*, response: str, label: Any, **_: Any) -> float:
    """1.0 when the response's final answer is mathematically equal to the label, as the
    `math-verify` package extracts (LaTeX, \\boxed{}, plain expressions) and compares them
    (symbolic equivalence, numeric tolerance, sets, intervals); else 0.0.

    The label is read as `\\boxed{label}` unless it already holds LaTeX delimiters, as verl
    does. math-verify's own signal-based time limits only work on the main thread, so they
    are off here; `reward.timeout_s` bounds the call instead."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # per-call timeout notices
    if label is None:
        raise ValueError("the math reward needs a label (data.label_key)")
    gold_text = str(label)
    if "\\boxed" not in gold_text and "$" not in gold_text:
        gold_text = "\\boxed{" + gold_text + "}"
    gold = parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify found no answer in the label {str(label)[:80]!r}")
    pred = parse(response, parsing_timeout=None)
    if not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of the response (```python ... ```), else the response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def code_tests(*, response: str, label: Any, meta: dict[str, Any], limits: SandboxLimits,
               total_timeout_s: float, **_: Any) -> dict[str, float]:
    """Run the response's code against the row's tests in the sandbox (one process per
    test, and one more for the assert tests' operands that are not the answer's); the
    reward is the fraction of tests passed.

    Tests (the label, or meta["tests"] when there is no label):
      - a string of Python test code (asserts), run after the code as one test;
      - a list of such strings, one test each;
      - {"inputs": [...], "outputs": [...]}: stdin → expected stdout, compared line by line
        with trailing whitespace ignored.
    An assert test passes when every assert holds, decided here: the sandbox runs the
    answer and reports only the values of the pieces of each assert that call it; the
    expected values, the comparisons and every operand that is not the answer's (computed
    in a second sandboxed process that never loads the answer) stay out of its process
    (sandbox/verdict.py, sandbox/harness.py). Test code that cannot be judged so (an
    assert inside a loop, a star import; see verdict.plan) is the row's error, as is test
    code without an assert.
    """
    tests = label if label is not None else (meta or {}).get("tests")
    code = extract_code(response)
    deadline = time.monotonic() + total_timeout_s
    cases: list[tuple[str, str, str | None]] = []  # (program, stdin, expected stdout)
    if isinstance(tests, str):
        tests = [tests]
    if isinstance(tests, dict) and set(tests) >= {"inputs", "outputs"}:
        ins, outs = tests["inputs"], tests["outputs"]
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError("tests: 'inputs' and 'outputs' must be lists of equal length")
        cases = [(code, str(i), str(o)) for i, o in zip(ins, outs)]
    elif isinstance(tests, list) and all(isinstance(t, str) for t in tests):
        cases = [(code, "", None) for _ in tests]
    else:
        raise ValueError(f"tests must be test code, a list of test code strings or "
                         f"{{inputs, outputs}}, got {type(tests).__name__}")
    if not cases:
        raise ValueError("the row has no tests")
    plans = [verdict.plan(t) for t in tests] if cases[0][2] is None else []

    def limited() -> SandboxLimits | None:
        left = deadline - time.monotonic()
        if left <= 0.5:
            return None  # the rest count as failed; the call stays within reward.timeout_s
        return SandboxLimits(**{**limits.__dict__, "timeout_s": min(limits.timeout_s, left)})

    def run_harness(spec: dict[str, Any]) -> str | None:
        lim = limited()
        if lim is None:
            return None
        return run_jailed(verdict.HARNESS, limits=lim.general(max_output=1 << 20),
                          files=verdict.harness_files(spec, code)).stdout

    if plans:
        passed = sum(verdict.check(plans, run_harness))
    else:
        passed = 0
        for prog, stdin, want in cases:
            lim = limited()
            if lim is None:
                break
            res = run_python(prog, stdin, lim)
            passed += res.returncode == 0 and _lines(res.stdout) == _lines(want)
    return {"reward": passed / len(cases), "all_passed": float(passed == len(cases))}


def _lines(s: str) -> list[str]:
    return [line.rstrip() for line in s.strip().splitlines()]


def make(name: str, reward_cfg: Any = None) -> Callable[..., Any]:
    """The built-in `name`, configured from RewardConfig (code_tests: sandbox limits)."""
    if name == "exact_match":
        return exact_match
    if name == "math":
        import math_verify  # noqa: F401  (a missing package is named at start)
        return math_answer
    if name == "code_tests":
        c = reward_cfg
        limits = SandboxLimits() if c is None else SandboxLimits(
            timeout_s=c.sandbox_timeout_s, memory_mb=c.sandbox_memory_mb, nproc=c.sandbox_nproc,
            user=c.sandbox_user, python=c.sandbox_python)
        interpreter(limits)  # probed now: a sandbox that cannot run fails at start
        return partial(code_tests, limits=limits,
                       total_timeout_s=(c.timeout_s if c is not None else 30.0) - 0.5)
    if name == "judge":  # needs the rollout's judge engine: rollout/feed.py builds it
        raise ValueError("reward 'judge' is a JudgeRunner (tsync_mcore.rewards.judge), not a "
                         "function")
    raise ValueError(f"no built-in reward {name!r}")
