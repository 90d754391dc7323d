"""Scorers that read model output run in jailed workers (reward.isolation, rewards/jailed.py):
the reward function as the rollout's DataFeed builds it and RewardRunner calls it. Answers
that reasoning-gym's own scorers `eval` (or sympy parses) run nothing on the host; an answer
that exits, kills its worker or computes for ever is that trajectory's error alone, killed at
reward.timeout_s while the rollout's event loop goes on; honest answers beside them keep the
task's own score.

On main these scorers ran in the rollout process as root: the marker appeared, `os._exit(3)`
ended the process and `7**10**7` held the event loop for seconds."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time

import pytest

from tsync_mcore.config import load_config
from tsync_mcore.rewards import RewardError

pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (make setup)")

EVAL_TASKS = ("spiral_matrix", "string_insertion", "binary_matrix", "n_queens")


def payload(marker: str) -> str:
    return f"<answer>[__import__('os').system('id > {marker}')]</answer>"


def feed_for(tmp_path, hf_dir, task: str, **sets):
    from tsync_mcore.rollout.feed import DataFeed
    cfg = load_config(None, {"model.hf_dir": hf_dir, "run.dir": str(tmp_path / "run"),
                             "rollout.env": f"reasoning_gym:{task}",
                             "reasoning_gym.train_size": 4, "reward.on_error": "zero",
                             "reward.timeout_s": 20.0, **sets})
    return DataFeed(cfg)


def dataset_feed(tmp_path, hf_dir, function: str, **sets):
    """A dataset run's feed scoring with reward.function (one row: "q" → label "1")."""
    from tsync_mcore.rollout.feed import DataFeed
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "q", "label": "1"}\n')
    cfg = load_config(None, {"model.hf_dir": hf_dir, "run.dir": str(tmp_path / "run"),
                             "rollout.env": "dataset", "data.train": str(data),
                             "data.label_key": "label", "reward.function": function,
                             "reward.on_error": "zero", **sets})
    return DataFeed(cfg)


def score(feed, response: str, index: int = 0, where: str = "trajectory t"):
    row = feed.train.row(index)
    return feed.runner.score(where, prompt=row.prompt, response=response, label=row.label,
                             meta=row.meta)


def own_score(feed, answer: str, index: int = 0) -> float:
    """reasoning-gym's own score of an honest answer (computed here: nothing hostile)."""
    import reasoning_gym
    row = feed.train.row(index)
    ds = reasoning_gym.create_dataset(feed.cfg.rollout.env.split(":")[1], seed=0, size=4)
    return ds.score_answer(answer=answer, entry={"question": row.prompt, "answer": row.label,
                                                 **row.meta})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", EVAL_TASKS + ("countdown",))
def test_payload_answers_run_nothing(tmp_path, tiny_qwen2, task):
    """The issue's payload, on every task whose scorer evaluates the answer (countdown: through
    sympy's parse_expr): no marker, the task's score for a non-answer; the honest answer
    beside it keeps the task's own score."""
    feed = feed_for(tmp_path, tiny_qwen2, task)
    marker = str(tmp_path / f"pwned-{task}")
    honest = f"<answer>{feed.train.row(0).label}</answer>"

    async def both():
        return await asyncio.gather(score(feed, payload(marker)), score(feed, honest))

    bad, good = asyncio.run(both())
    assert not os.path.exists(marker), f"{task}: the payload ran: {open(marker).read()!r}"
    assert good.error is None and good.reward == own_score(feed, str(feed.train.row(0).label))
    assert good.reward == 1.0
    if task == "countdown":  # countdown scores any unusable answer 0.01, never 0
        assert bad.reward <= 0.05, bad
    else:
        assert bad.reward == 0.0 and bad.error is None, bad


@pytest.mark.timeout(300)
def test_exits_kills_and_big_numbers_are_one_trajectorys_error(tmp_path, tiny_qwen2):
    """A scorer that evaluates the answer (a user's, as reasoning-gym's eval tasks did before
    they read answers as literals): exit(3)-style answers and one that kills its worker are
    an error for that trajectory only; `7**10**7` is killed at reward.timeout_s while the
    event loop keeps ticking; the honest answers gathered beside them keep their scores; the
    next call works."""
    rw = tmp_path / "evaluating.py"
    rw.write_text("def reward(*, response, label, **_):\n"
                  "    return float(str(eval(response)) == label)\n")
    feed = dataset_feed(tmp_path, tiny_qwen2, f"{rw}:reward", **{"reward.timeout_s": 3.0})
    honest = "1"
    hostile = {
        "sys.exit": "[__import__('sys').exit(3)]",
        "os._exit": "[__import__('os')._exit(3)]",
        "big": "[7**10**7]",
        "kill worker": "[__import__('os').kill(__import__('os').getppid(), 9)]",
    }
    gaps: list[float] = []

    async def run():
        async def tick():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        results = await asyncio.gather(*(score(feed, r, where=f"trajectory {k}")
                                         for k, r in hostile.items()),
                                       *(score(feed, honest) for _ in range(3)))
        wall = time.monotonic() - t0
        ticker.cancel()
        return results, wall

    results, wall = asyncio.run(run())
    bad, good = dict(zip(hostile, results)), results[len(hostile):]
    for k, res in bad.items():
        assert res.reward == 0.0 and res.error and "\n" not in res.error, (k, res)
        assert f"on trajectory {k}" in res.error
    assert "raised SystemExit: 3" in bad["sys.exit"].error
    assert "exited with status 3" in bad["os._exit"].error
    assert "reward.timeout_s" in bad["big"].error
    assert "died mid-call" in bad["kill worker"].error
    assert all(g.reward == 1.0 and g.error is None for g in good), good
    assert wall < 3.0 + 10.0  # killed at the limit (a loaded machine: time to spare)
    assert max(gaps) < 0.5, f"the event loop stalled {max(gaps):.2f}s"
    # the pool goes on: a fresh worker for the one that died
    again = asyncio.run(score(feed, honest))
    assert again.reward == 1.0 and again.error is None


@pytest.mark.timeout(300)
def test_user_reward_functions_run_in_the_jail(tmp_path, tiny_qwen2):
    """A user's reward.function runs as a uid that is not root (its file's text handed over:
    pytest's root-only tmp directory is fine); one whose import cannot work in the jail is
    refused at start in one line; reward.isolation: none keeps it in-process."""
    rw = tmp_path / "reward.py"
    rw.write_text(textwrap.dedent("""
        import os
        def reward(*, prompt, response, label, meta, **_):
            return {"reward": float(response == label), "uid": float(os.getuid())}
    """))
    feed = dataset_feed(tmp_path, tiny_qwen2, f"{rw}:reward", **{"reward.timeout_s": 20.0})
    res = asyncio.run(feed.runner.score("trajectory t", prompt="q", response="1", label="1",
                                        meta={"k": (1, 2)}))
    assert res.reward == 1.0 and res.error is None, res
    if os.geteuid() == 0:
        assert res.extras["uid"] != 0.0, res
    bad = tmp_path / "bad.py"
    bad.write_text("import tsync_no_such_module\ndef reward(**kw):\n    return 1.0\n")
    with pytest.raises(RewardError, match="cannot run in the jail.*tsync_no_such_module") as e:
        dataset_feed(tmp_path, tiny_qwen2, f"{bad}:reward")
    assert "\n" not in str(e.value) and "reward.isolation: none" in str(e.value)
    trusted = dataset_feed(tmp_path, tiny_qwen2, f"{rw}:reward", **{"reward.isolation": "none"})
    res = asyncio.run(trusted.runner.score("t", prompt="q", response="1", label="1", meta={}))
    assert res.extras["uid"] == float(os.getuid())


@pytest.mark.timeout(300)
def test_math_scores_in_the_jail(tmp_path, tiny_qwen2):
    """The `math` built-in (math-verify, sympy) through the pool: the same scores; an answer
    whose evaluation never ends (sympy computing 9^(9^9)) is killed at reward.timeout_s while
    the event loop goes on (in-process, a thread nothing could stop computed it for ever)."""
    pytest.importorskip("math_verify")
    runner = dataset_feed(tmp_path, tiny_qwen2, "math", **{"reward.timeout_s": 3.0}).runner
    gaps: list[float] = []

    async def run():
        async def tick():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        out = await asyncio.gather(
            runner.score("a", prompt="", response="so \\boxed{\\frac{1}{2}}", label="0.5",
                         meta={}),
            runner.score("b", prompt="", response="\\boxed{3}", label="0.5", meta={}),
            runner.score("c", prompt="", response="\\boxed{2}", label=None, meta={}),
            runner.score("d", prompt="", response="\\boxed{9^{9^{9}}}", label="1", meta={}))
        ticker.cancel()
        return out

    t0 = time.monotonic()
    a, b, c, d = asyncio.run(run())
    assert (a.reward, b.reward) == (1.0, 0.0) and a.error is None and b.error is None
    assert c.reward == 0.0 and "needs a label" in c.error
    assert d.reward == 0.0 and "reward.timeout_s" in d.error, d
    assert time.monotonic() - t0 < 3.0 + 10.0 and max(gaps) < 0.5, max(gaps)
