"""Reward functions: loading specs, calling conventions (sync, async, extras), failures
under both reward.on_error modes, pass@k, and the built-ins (math-verify, code sandbox)."""

import asyncio
import math
import os
import textwrap
import time

import pytest

from tsync_mcore.config import RewardConfig
from tsync_mcore.rewards import (RewardError, RewardFailed, RewardRunner, RewardStats,
                                 load_reward_fn, pass_at_k)
from tsync_mcore.rewards.builtins import code_tests, exact_match, extract_code, math_answer
from tsync_mcore.rewards.call import eval_metrics
from tsync_mcore.rewards.sandbox import SandboxLimits, run_python

KW = dict(prompt=[{"role": "user", "content": "2+3?"}], response="5", label="5",
          meta={"source": "a"})


def write(tmp_path, body, name="rw.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def run(coro):
    return asyncio.run(coro)


def runner(fn, on_error="fail", timeout_s=5.0, spec="test"):
    return RewardRunner(fn, spec=spec, timeout_s=timeout_s, on_error=on_error)


def test_file_and_module_specs_load(tmp_path, monkeypatch):
    f = write(tmp_path, """
        def score(prompt, response, label, meta):
            return float(response == label)
        """)
    assert load_reward_fn(f"{f}:score")(**KW) == 1.0
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text("def score(**kw):\n    return 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("mypkg.rewards:score")(**KW) == 0.25
    assert load_reward_fn("exact_match") is exact_match


@pytest.mark.parametrize("spec, body, match", [
    ("nonsense", None, "neither a built-in"),
    ("{d}/missing.py:f", None, "no file"),
    ("{f}:nope", "def score(**kw): return 1\n", "defines no 'nope'"),
    ("{f}:X", "X = 3\n", "X is a int, not callable"),
    ("{f}:score", "raise RuntimeError('boom at import')\n",
     "importing .* failed: RuntimeError: boom"),
    ("{f}:score", "def score(response): return 1\n", "lacks prompt, label, meta"),
    ("no_such_pkg_xyz.mod:f", None, "no module 'no_such_pkg_xyz'"),
])
def test_bad_specs_are_one_line_errors(tmp_path, spec, body, match):
    f = write(tmp_path, body, f"r{abs(hash(spec + str(body))) % 10**6}.py") if body else ""
    spec = spec.format(d=tmp_path, f=f)
    with pytest.raises(RewardError, match=match) as e:
        load_reward_fn(spec)
    assert "\n" not in str(e.value) and spec in str(e.value)


def test_sync_function_gets_the_documented_arguments_off_the_event_loop():
    import threading
    calls = []

    def score(prompt, response, label, meta):
        calls.append((dict(prompt=prompt, response=response, label=label, meta=meta),
                      threading.get_ident()))
        return 1

    async def go():
        return threading.get_ident(), await runner(score).score("trajectory t0 (row 3)", **KW)

    loop_thread, res = run(go())
    assert res.reward == 1.0 and res.error is None and res.extras == {}
    assert calls[0][0] == KW and calls[0][1] != loop_thread  # ran in a worker thread


def test_async_function_extras_and_messages():
    async def score(prompt, response, label, meta, messages):
        await asyncio.sleep(0)
        return {"reward": 0.5, "format": True, "length": len(response)}

    r = runner(score)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "5"}]
    res = run(r.score("t", messages=msgs, **KW))
    assert res.reward == 0.5 and res.extras == {"format": 1.0, "length": 1.0}
    seen = []
    r2 = runner(lambda **kw: seen.append(sorted(kw)) or 0.0)
    run(r2.score("t", messages=msgs, **KW))
    assert seen == [["label", "messages", "meta", "prompt", "response"]]
    st = RewardStats()
    st.add(res)
    st.add(run(runner(lambda **kw: {"reward": 1, "format": 0}).score("t", **KW)))
    assert st.metrics() == {"reward/errors": 0, "reward/format": 0.5, "reward/length": 1.0}


def _sleepy(**kw):
    time.sleep(3)
    return 1.0


async def _async_sleepy(**kw):
    await asyncio.sleep(30)


def _raises(**kw):
    raise KeyError("answer")


@pytest.mark.parametrize("fn, why", [
    (_sleepy, r"timed out after 0.3s"),
    (_async_sleepy, r"timed out after 0.3s"),
    (_raises, r"raised KeyError: 'answer'"),
    (lambda **kw: "1.0", r"reward is str '1.0', not a number"),
    (lambda **kw: float("nan"), r"reward is nan, not finite"),
    (lambda **kw: {"score": 1.0}, r"mapping without 'reward'"),
    (lambda **kw: {"reward": 1.0, "bad": [1]}, r"extra 'bad' is list"),
    (lambda **kw: None, r"reward is NoneType"),
])
def test_failures_fail_or_score_zero_and_never_hang(fn, why):
    where = "trajectory v0-g1-t2 (data.jsonl row 17)"
    t0 = time.monotonic()
    with pytest.raises(RewardFailed, match=why) as e:
        run(runner(fn, "fail", timeout_s=0.3).score(where, **KW))
    assert where in str(e.value) and "\n" not in str(e.value)
    res = run(runner(fn, "zero", timeout_s=0.3).score(where, **KW))
    assert res.reward == 0.0 and where in res.error
    st = RewardStats()
    st.add(res)
    assert st.metrics()["reward/errors"] == 1
    assert time.monotonic() - t0 < 3.0  # both calls, timeouts included


def test_pass_at_k_equals_the_binomial_formula():
    for n in (1, 4, 10, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert abs(pass_at_k(n, c, k) - want) < 1e-12, (n, c, k)
    m = eval_metrics([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], 4)
    assert m["eval/reward_mean"] == 0.25
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2)) / 2)
    assert m["eval/pass@4"] == pytest.approx(0.5) and "eval/pass@3" not in m


def test_exact_match():
    assert exact_match(response="  42 \n", label="42") == 1.0
    assert exact_match(response="one  two", label="one two") == 1.0
    assert exact_match(response="41", label=42) == 0.0
    assert exact_match(response="b", label=["a", "b"]) == 1.0


@pytest.mark.parametrize("response, label, want", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so $x = \\frac{6}{4}$", "\\frac{3}{2}", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("The result is 72.", "72", 1.0),
    ("\\boxed{(1, 3]}", "(1,3]", 1.0),
    ("\\boxed{0.3333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{73}", "72", 0.0),
    ("no answer here", "72", 0.0),
])
def test_math_builtin_uses_math_verify_equivalence(response, label, want):
    assert math_answer(response=response, label=label) == want


LIM = SandboxLimits(timeout_s=3.0, memory_mb=256, nproc=16)


def run_tests(code, tests, **kw):
    return code_tests(response=code, label=tests, meta={}, limits=LIM, total_timeout_s=20,
                      **kw)


def test_code_tests_pass_and_fail():
    code = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert extract_code(code).strip().startswith("def add")
    assert run_tests(code, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]) == \
        {"reward": 1.0, "all_passed": 1.0}
    assert run_tests(code, ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]) == \
        {"reward": 0.5, "all_passed": 0.0}
    io = {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10"]}
    assert run_tests("print(int(input()) * 2)", io)["reward"] == 1.0
    assert run_tests("print(int(input()) + 2)", io)["reward"] == 0.5
    # an early exit(0) skips the tests and the marker behind them: no pass
    assert run_tests("import sys\nsys.exit(0)", "assert False")["reward"] == 0.0
    assert code_tests(response="x=1", label=None, meta={"tests": ["assert x == 1"]},
                      limits=LIM, total_timeout_s=20)["reward"] == 1.0
    with pytest.raises(ValueError, match="tests must be"):
        run_tests("x=1", 3)


def test_sandbox_contains_loops_memory_hogs_and_fork_bombs():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", "", LIM)
    # cut by the wall-time kill or by RLIMIT_CPU, whichever comes first (loose time bound: a
    # loaded machine is slow to reap; uncut, it never ends)
    assert (r.timed_out or r.returncode in (-9, -24)) and time.monotonic() - t0 < 30
    r = run_python("import time\ntime.sleep(60)\n", "", LIM)
    assert r.timed_out
    r = run_python("x = bytearray(1 << 30)\nprint('allocated')\n", "", LIM)
    assert r.returncode != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout
    t0 = time.monotonic()
    r = run_python("import os, time\nfor _ in range(10000):\n    os.fork()\n"
                   "time.sleep(30)\n", "", LIM)
    assert time.monotonic() - t0 < 30 and r.returncode != 0 or r.timed_out
    assert "Resource temporarily unavailable" in r.stderr or r.timed_out
    # a background child does not outlive the program: its process group is killed
    r = run_python("import os, subprocess, sys, time\n"
                   "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                   "print(os.getpgid(p.pid), flush=True)\n", "", LIM)
    pgid = int(r.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    # output files are bounded (RLIMIT_FSIZE), the run's secrets are not inherited
    os.environ["TSYNC_TEST_SECRET"] = "hunter2"
    try:
        r = run_python("import os\nprint(sorted(os.environ))\nprint(os.getcwd())\n", "", LIM)
    finally:
        del os.environ["TSYNC_TEST_SECRET"]
    assert "TSYNC_TEST_SECRET" not in r.stdout and "tsync-sandbox-" in r.stdout
    if os.geteuid() == 0:  # root drops to nobody, so RLIMIT_NPROC binds
        assert run_python("import os\nprint(os.getuid())\n", "", LIM).stdout.strip() == "65534"


def test_code_tests_builtin_from_config_and_deadline():
    cfg = RewardConfig(function="code_tests", timeout_s=4.0, sandbox_timeout_s=8.0,
                       sandbox_memory_mb=256)
    fn = load_reward_fn("code_tests", cfg)
    t0 = time.monotonic()
    out = fn(prompt="p", response="while True:\n    pass",
             label=["assert True"] * 5, meta={})
    # each test would take its 8 s (40 s in all); the call stops at reward.timeout_s (loose
    # bound for a loaded machine)
    assert out["reward"] == 0.0 and time.monotonic() - t0 < 20


def test_a_hung_sync_call_does_not_hold_up_the_process_exit():
    import subprocess
    import sys
    code = textwrap.dedent("""
        import asyncio, time
        from tsync_mcore.rewards import RewardRunner
        r = RewardRunner(lambda **kw: time.sleep(1000), spec="hang", timeout_s=0.2,
                         on_error="zero")
        res = asyncio.run(r.score("t", prompt="p", response="r", label=None, meta={}))
        print(res.reward, "timed out" in res.error)
        """)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0 and p.stdout.split() == ["0.0", "True"], p.stderr[-2000:]
    assert time.monotonic() - t0 < 30
