"""Reward functions: loading specs, calling conventions (sync, async, extras), failures
under both reward.on_error modes, pass@k, and the built-ins (math-verify, code sandbox)."""

import asyncio
import math
import sys
import textwrap
import time

import pytest

from tsync_mcore.rewards import (
    RewardError,
    RewardFailed,
    RewardRunner,
    RewardStats,
    load_reward_fn,
    pass_at_k,
)
from tsync_mcore.rewards.builtins import exact_match, math_answer
from tsync_mcore.rewards.call import eval_metrics

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


def _exits(**kw):
    sys.exit(3)


def _interrupts(**kw):
    raise KeyboardInterrupt


async def _async_blocks(**kw):
    time.sleep(2)  # blocks whatever loop it runs on: not the rollout's


async def _async_exits(**kw):
    sys.exit("bye")


@pytest.mark.parametrize("fn, why", [
    (_sleepy, r"timed out after 0.3s"),
    (_async_sleepy, r"timed out after 0.3s"),
    (_raises, r"raised KeyError: 'answer'"),
    (_exits, r"raised SystemExit: 3"),
    (_interrupts, r"raised KeyboardInterrupt"),
    (_async_blocks, r"timed out after 0.3s"),
    (_async_exits, r"raised SystemExit: bye"),
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


def test_overlong_shaping_is_dapos_soft_penalty():
    """reward.overlong_buffer: verl's DAPO reward manager's formula, written out here:
    min(−(L − (L_max − b))/b · f, 0) added to the reward; L the generated tokens."""
    from types import SimpleNamespace

    from tsync_mcore.config import RewardConfig, RolloutConfig
    from tsync_mcore.rollout.sources import shaped_reward
    rc = RolloutConfig(max_tokens_per_turn=32, max_turns=2)  # L_max = 64
    work = SimpleNamespace(cfg=SimpleNamespace(reward=RewardConfig(
        overlong_buffer=16, overlong_penalty=0.5)), rc=rc, overlong=0)
    from tsync_mcore.rollout.types import TrajectoryResult

    def shaped(n, r=1.0, earlier=0):
        """A response of n generated tokens, `earlier` of them in an earlier segment."""
        seg = dict(tokens=[1] * (5 + earlier), scored_mask=[0] * 5 + [1] * earlier,
                   logprobs=[], token_versions=[], prompt_len=5)
        res = TrajectoryResult(tokens=[1] * (5 + n - earlier),
                               scored_mask=[0] * 5 + [1] * (n - earlier), turn_ends=[],
                               reward=r, prompt_len=5, n_turns=1, logprobs=[],
                               finish_reasons=[], policy_versions=[], token_versions=[],
                               stop_reason="done", earlier=[seg] if earlier else [])
        reward, penalised = shaped_reward(res, work.cfg.reward, work.rc)
        work.overlong += penalised  # the batch's count of penalised responses
        return reward
    assert shaped(48) == 1.0 and shaped(10) == 1.0  # within L_max − b: untouched
    # a trajectory cut into segments: L counts every segment's generated tokens
    assert shaped(56, earlier=30) == pytest.approx(1.0 - (56 - 48) / 16 * 0.5)
    work.overlong = 0
    assert shaped(56) == pytest.approx(1.0 - (56 - 48) / 16 * 0.5)
    assert shaped(64, r=0.0) == pytest.approx(-0.5)  # at the budget: the whole penalty
    assert work.overlong == 2
    work.cfg.reward.overlong_max_len = 100  # an explicit budget
    assert shaped(90) == pytest.approx(1.0 - (90 - 84) / 16 * 0.5)
    work.cfg.reward.overlong_buffer = 0  # off
    assert shaped(10**4) == 1.0


def test_scorer_wire_is_bounded_and_keeps_tuples():
    """The frames between the rollout and its jailed scorers (rewards/wire.py): tuples come
    back as tuples, what JSON cannot hold is refused, and a frame over its bound, cut short
    or not JSON is a one-line FrameError, never a hang (a deadline) or a partial value."""
    import os

    from tsync_mcore.rewards import wire

    entry = {"answer": "1 2", "metadata": {"difficulty": {"n": (2, 5)}, "m": [[1, 2]]}}
    assert wire.decode(wire.encode(entry)) == entry
    assert wire.decode(wire.encode(entry))["metadata"]["difficulty"]["n"] == (2, 5)
    for bad in ({1: 2}, {"x": {1, 2}}, object()):
        with pytest.raises(TypeError):
            wire.encode(bad)

    def frames(data: bytes, limit: int = 1 << 10, deadline: float | None = None):
        r, w = os.pipe()
        os.write(w, data)
        os.close(w)
        try:
            return wire.read_frame(r, limit, deadline)
        finally:
            os.close(r)

    assert frames(wire.dump({"ok": {"reward": 1.0}})) == {"ok": {"reward": 1.0}}
    assert frames(b"") is None  # end of input: the worker exits
    for data, match in ((wire.HEADER.pack(1 << 20) + b"{}", "a frame of 1048576 bytes"),
                        (wire.HEADER.pack(10) + b"{}", "cut short"),
                        (wire.HEADER.pack(3) + b"{x}", "not JSON"),
                        (b"\x00\x00", "cut short")):
        with pytest.raises(wire.FrameError, match=match) as e:
            frames(data)
        assert "\n" not in str(e.value)
    r, w = os.pipe()  # nothing written, the writer still open: the deadline ends the wait
    try:
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            wire.read_frame(r, 100, time.monotonic() + 0.05)
        assert time.monotonic() - t < 1.0
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("key, value, match", [
    ("reward.isolation", "jail", "reward.isolation"),
    ("reward.workers", 0, "'reward.workers': must be >= 1"),
    ("reward.scorer_memory_mb", 64, "'reward.scorer_memory_mb': must be >= 256"),
    ("rollout.structured_regex", "(unclosed", "'rollout.structured_regex': is not a regular"),
])
def test_scorer_jail_keys_are_checked(key, value, match):
    from tsync_mcore.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, {"model.hf_dir": "m", key: value})
    assert "\n" not in str(e.value)
