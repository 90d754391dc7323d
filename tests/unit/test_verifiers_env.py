"""rollout.env: verifiers:<module> without processes: the config keys, loading an env module
(each failure one line naming verifiers:<module>), its datasets as rows, the agent's
guarded rubric scoring (a reward function that raises or returns a non-number is an error,
not verifiers' silent 0), and reward.on_error on the rollout side."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap

import pytest

from tests.helpers.paths import ROOT
from tsync_mcore.config import ConfigError, load_config
from tsync_mcore.data import DataError
from tsync_mcore.rewards import RewardFailed

pytest.importorskip("verifiers", reason="needs verifiers (make setup)")
from tsync_mcore.rollout import vf_env  # noqa: E402

TINY = os.path.join(ROOT, "configs", "verifiers_tiny.yaml")
DIGITS = "tsync_mcore.rollout.vf_digits"

# An env module the tests control: its rubric's second function misbehaves as `mode` says.
ENV_MODULE = '''
import math
import verifiers as vf
from datasets import Dataset

def exact(completion, answer):
    return float(completion[-1]["content"].strip() == answer)

def make_bad(mode):
    def bad(completion):
        if mode == "raise":
            raise KeyError("boom")
        if mode == "exit":
            raise SystemExit(3)
        return {"nan": math.nan, "text": "high", "ok": 0.5, "huge": 1e9}[mode]
    return bad

def load_environment(mode="ok", group=False):
    funcs = [exact, make_bad(mode)]
    if group:
        def spread(completions, answers):
            return [0.0] * len(completions)
        funcs.append(spread)
    ds = Dataset.from_list([{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}])
    return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=funcs), system_prompt="Be brief.")
'''


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Env modules in a temporary directory on sys.path; the process's signal handlers are
    as they were afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    made = []

    def write(name: str, text: str) -> str:
        name = f"{name}_{len(made)}_{os.getpid()}_{abs(hash(str(tmp_path)))}"  # never cached
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
        made.append(name)
        return name
    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in made:
        sys.modules.pop(name, None)
    for s, h in saved.items():
        signal.signal(s, h)


# --- config -----------------------------------------------------------------------------

def test_the_example_config_loads():
    cfg = load_config(TINY)
    assert cfg.rollout.env == f"verifiers:{DIGITS}" and cfg.verifiers.args == {"max_turns": 2}


@pytest.mark.parametrize("override,key", [
    ({"rollout.agent": "builtin"}, "rollout.agent"),
    ({"rollout.env": "verifiers:my-env"}, "rollout.env"),
    ({"rollout.env": "verifiers:"}, "rollout.env"),
    ({"data.train": "x.jsonl"}, "data.train"),
    ({"data.system_prompt": "Be brief."}, "data.system_prompt"),
    ({"reward.function": "exact_match"}, "reward.function"),
    ({"verifiers.args": {"n": float("nan")}}, "verifiers.args"),
    ({"learner.objective": "opd", "rollout.teacher_dir": "t"}, "rollout.env"),
])
def test_config_refuses(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, override)
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)


# --- loading ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,args,says", [
    (None, {}, "no module named 'tsync_no_such_env'"),
    ("import tsync_missing_dependency\n", {}, "importing it failed: ModuleNotFoundError: "
                                              "No module named 'tsync_missing_dependency'"),
    ("1 / 0\n", {}, "importing it failed: ZeroDivisionError"),
    ("x = 1\n", {}, "the module has no load_environment()"),
    ("def load_environment():\n    return 42\n", {}, "returned int, not a verifiers Environment"),
    ("def load_environment(**kw):\n    raise RuntimeError('no data')\n", {},
     "load_environment(**{}) raised RuntimeError: no data"),
    ("def load_environment(n=1):\n    pass\n", {"m": 2}, "does not take ['m']"),
])
def test_a_bad_env_module_is_one_line(modules, text, args, says):
    name = "tsync_no_such_env" if text is None else modules("tsync_bad_env", text)
    says = says.replace("tsync_no_such_env", name)
    with pytest.raises(DataError) as e:
        vf_env.load_env(name, args)
    msg = str(e.value)
    assert says in msg and "\n" not in msg, msg
    assert (f"verifiers:{name}" in msg) or "verifiers.args" in msg


def test_group_reward_functions_are_refused(modules):
    name = modules("tsync_grp_env", ENV_MODULE)
    with pytest.raises(DataError, match="group reward functions"):
        vf_env.load_env(name, {"group": True})


def test_loading_keeps_the_process_signal_handlers(modules):
    name = modules("tsync_ok_env", ENV_MODULE)
    before = signal.getsignal(signal.SIGTERM)
    vf_env.load_env(name, {})
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_example_envs_datasets_are_rows():
    env = vf_env.load_env(DIGITS, {"max_turns": 2})
    train = vf_env.VerifiersSet(DIGITS, env, "train")
    ev = vf_env.VerifiersSet(DIGITS, env, "eval")
    from tsync_mcore.rollout import vf_digits
    assert (len(train), len(ev)) == (len(vf_digits.TRAIN), len(vf_digits.EVAL))
    row = train.row(1)
    assert row.prompt == [{"role": "system", "content": vf_digits.SYSTEM_PROMPT},
                          {"role": "user", "content": "Write the number 271 in digits."}]
    assert row.label == "271" and row.meta["example_id"] == 1


def test_a_feed_over_the_example_env(modules):
    from tsync_mcore.rollout.feed import DataFeed
    feed = DataFeed(load_config(TINY))
    assert feed.vf == DIGITS and len(feed.train) == 8 and len(feed.eval) == 3
    assert [feed.train_row(p) for p in range(8)] != list(range(8))  # shuffled epochs
    name = modules("tsync_noeval_env", ENV_MODULE)  # no eval_dataset: evaluation refused
    with pytest.raises(DataError, match=rf"run.eval_every: verifiers:{name} has no "
                                        r"eval_dataset"):
        DataFeed(load_config(TINY, {"rollout.env": f"verifiers:{name}", "verifiers.args": {},
                                    "run.eval_every": 1}))


# --- scoring (the agent's side) ---------------------------------------------------------

def _score(env, completion: str):
    """The guarded rubric on a state made by verifiers itself for row 0."""
    import openai
    import verifiers as vf
    errors = vf_env.guard_rubric(env.rubric)

    async def go():
        client = vf.OpenAIChatCompletionsClient(
            openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused"))
        state = await env.init_state(dict(env.get_dataset()[0]), client, "m")
        state["completion"] = [{"role": "assistant", "content": completion}]
        return await vf_env.score(env, state, errors)
    return asyncio.run(go())


def test_the_rubric_scores_as_verifiers_does(modules):
    env = vf_env.load_env(modules("tsync_ok_env", ENV_MODULE), {"mode": "ok"})
    assert _score(env, "4") == (1.5, {"exact": 1.0, "bad": 0.5, "num_turns": 0.0})
    assert _score(env, "5") == (0.5, {"exact": 0.0, "bad": 0.5, "num_turns": 0.0})


@pytest.mark.parametrize("mode,says", [
    ("raise", "reward function bad raised KeyError: 'boom'"),
    ("exit", "reward function bad raised SystemExit: 3"),
    ("nan", "reward function bad returned float 'nan', not a finite number"),
    ("text", "reward function bad returned str 'high', not a finite number"),
    ("huge", "the rubric's reward is 1000000001.0, not a finite number with |reward| <= 1e6"),
])
def test_a_misbehaving_reward_function_is_an_error_not_a_zero(modules, mode, says):
    env = vf_env.load_env(modules(f"tsync_{mode}_env", ENV_MODULE), {"mode": mode})
    with pytest.raises(vf_env.ScoreError) as e:
        _score(env, "4")
    assert str(e.value) == says


# --- reward.on_error (the rollout's side) -----------------------------------------------

def test_a_reward_error_follows_reward_on_error():
    from tsync_mcore.data.load import Row
    from tsync_mcore.rollout.feed import BatchStats
    row = Row(index=3, prompt="p", label="4", meta={})
    where = "trajectory v0-g1-t0 (verifiers:m train dataset row 3)"
    with pytest.raises(RewardFailed) as e:
        vf_env.VerifiersTask("m", row, where, "fail").reward_error("reward function bad raised X")
    assert str(e.value) == ("verifiers:m rubric on trajectory v0-g1-t0 (verifiers:m train "
                            "dataset row 3): reward function bad raised X")
    task = vf_env.VerifiersTask("m", row, where, "zero")
    assert task.reward_error("reward function bad raised X") == 0.0
    stats = BatchStats()
    stats.add(task)
    assert stats.metrics()["reward/errors"] == 1 and "v0-g1-t0" in stats.first_error
    # an agent that exits without posting a reward: the same rule
    quiet = vf_env.VerifiersTask("m", row, where, "zero")
    quiet.reset(0)
    asyncio.run(quiet.step([1, 2]))
    assert quiet.reward() == 0.0 and "posted no reward" in quiet.result.error
