"""rollout.env: reasoning_gym:<task>: sets generated per seed, train and eval kept apart,
the task's scorer behind the project's reward path, resume by data position, and every
bad input as one line naming its config key."""

import asyncio
import sys

import pytest

from tsync_mcore.config import ConfigError, load_config
from tsync_mcore.data import DataError
from tsync_mcore.data.rgym import task_sets
from tsync_mcore.rewards import RewardFailed, RewardRunner
from tsync_mcore.rewards.rgym import extract_answer, task_reward

TASK = "basic_arithmetic"
# a small question space (one-digit a + b, 100 questions), so seed ranges collide in content
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
         "allow_parentheses": False, "allow_negation": False}


@pytest.fixture
def tok(tiny_qwen2):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen2)


def sets(params=None, **kw):
    args = dict(train_seed=0, train_size=20, eval_seed=1000, eval_size=10) | kw
    return task_sets(TASK, params or {}, **args)


def qa(ts):
    return [(ts.row(i).prompt, ts.row(i).label) for i in range(len(ts))]


def rg_cfg(tmp_path, hf_dir, **sets_):
    """In-process scorers (reward.isolation none: unit tests start no process); the jailed
    ones: tests/integration/test_scorer_jail.py."""
    base = {"model.hf_dir": hf_dir, "run.dir": str(tmp_path / "run"),
            "rollout.env": f"reasoning_gym:{TASK}", "rollout.max_total_tokens": 200,
            "reasoning_gym.train_size": 8, "reasoning_gym.eval_size": 4,
            "reward.isolation": "none"}
    return load_config(None, {**base, **sets_})


def test_same_seed_same_entries_other_seed_differs():
    train, ev = sets()
    train2, ev2 = sets()
    assert qa(train) == qa(train2) and qa(ev) == qa(ev2)
    assert all(isinstance(q, str) and q and isinstance(a, str) for q, a in qa(train))
    # the task's metadata travels as the row's meta
    assert train.row(3).meta["metadata"]["source_index"] == 3
    other, _ = sets(train_seed=500)
    assert [q for q, _ in qa(other)] != [q for q, _ in qa(train)]
    # reasoning-gym's rule: entry i of seed s is entry 0 of seed s + i
    shifted, _ = sets(train_seed=5, train_size=3, eval_size=0)
    assert qa(shifted) == qa(train)[5:8]


def test_eval_leaves_out_questions_training_has():
    train, ev = sets(SMALL, train_size=60, eval_size=60)
    seen = {q for q, _ in qa(train)}
    assert ev.left_out > 0 and len(ev) == 60 - ev.left_out
    assert not seen & {q for q, _ in qa(ev)}
    _, none = sets(SMALL, eval_size=0)
    assert none is None
    with pytest.raises(DataError, match="'reasoning_gym.eval_size': all 3 questions") as e:
        # seeds 0..199 draw every one of the 100 questions; a 3-entry eval set has no new one
        sets(SMALL, train_size=400, eval_seed=400, eval_size=3)
    assert "\n" not in str(e.value)


def test_answer_extraction_follows_reasoning_gyms_tags():
    assert extract_answer("think... <answer> 7 </answer> then <answer>8</answer>", "answer") == "8"
    assert extract_answer("7", "answer") is None
    assert extract_answer("  7\n", "") == "7"
    assert extract_answer("<final>42</final>", "final") == "42"
    assert extract_answer("3 + 4 = 7, so it is -1.5 then 12.", "answer", "last_number") == "12"
    assert extract_answer("it is -1.5", "", "last_number") == "-1.5"
    assert extract_answer("none here", "answer", "last_number") is None


def test_the_tasks_scorer_through_the_dataset_env(tmp_path, tiny_qwen2, tok):
    """Prompt ids are the question through the chat template (with data.system_prompt); the
    answer is scored by the task's own score_answer through RewardRunner."""
    from tsync_mcore.rollout.feed import DataFeed
    cfg = rg_cfg(tmp_path, tiny_qwen2, **{"data.system_prompt": "Be brief."})
    feed = DataFeed(cfg)
    feed.attach(tok)
    rows = [feed.train_row(p) for p in range(3)]
    envs = feed.train_envs(rows, ["a", "b", "c"])
    for env, r in zip(envs, rows):
        q, answer = feed.train.row(r).prompt, feed.train.row(r).label
        ids = env.reset(seed=r)
        assert tok.decode(ids) == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                   f"{q}<|im_end|>\n<|im_start|>assistant\n")
        for text, want in ((f"It is <answer>{answer}</answer>", 1.0),
                           (f"<answer>{int(answer) + 1}</answer>", 0.0),
                           (answer, 0.0)):  # no tags: no answer
            env.reset(seed=r)
            _, done = asyncio.run(env.step(tok(text).input_ids))
            assert done and env.reward() == want and env.result.error is None, text
    # answer_tag "": the whole completion is the answer
    cfg.reasoning_gym.answer_tag = ""
    feed = DataFeed(cfg)
    feed.attach(tok)
    env = feed.train_envs([0], ["t"])[0]
    env.reset(seed=0)
    asyncio.run(env.step(tok(f" {feed.train.row(0).label}\n").input_ids))
    assert env.reward() == 1.0
    # answer_from last_number: the completion's last number, whatever surrounds it
    cfg.reasoning_gym.answer_from = "last_number"
    feed = DataFeed(cfg)
    feed.attach(tok)
    label = feed.train.row(0).label
    for text, want in ((f"The answer is {label}.", 1.0), (f"{label} or {int(label) + 1}", 0.0),
                       ("no number", 0.0)):
        env = feed.train_envs([0], ["t"])[0]
        env.reset(seed=0)
        asyncio.run(env.step(tok(text).input_ids))
        assert env.reward() == want, text
    # evaluation rows run the same way
    ev = feed._env(feed.eval, 1, "eval sample 0")
    ev.reset(seed=0)
    asyncio.run(ev.step(tok(feed.eval.row(1).label).input_ids))
    assert ev.reward() == 1.0


def test_scorer_failures_follow_reward_on_error():
    class Broken:
        def score_answer(self, answer, entry):
            raise KeyError("metadata")

    kw = dict(prompt="Calculate 2 + 3.", response="<answer>5</answer>", label="5",
              meta={"metadata": {}})
    fn = task_reward(Broken(), "answer")
    zero = RewardRunner(fn, spec="reasoning_gym:x scorer", timeout_s=5.0, on_error="zero")
    res = asyncio.run(zero.score("trajectory t", **kw))
    assert res.reward == 0.0 and "raised KeyError" in res.error
    fail = RewardRunner(fn, spec="reasoning_gym:x scorer", timeout_s=5.0, on_error="fail")
    with pytest.raises(RewardFailed, match="reasoning_gym:x scorer on trajectory t"):
        asyncio.run(fail.score("trajectory t", **kw))


def test_resumed_feed_visits_the_same_rows(tmp_path, tiny_qwen2):
    """Data position p names the same question in a fresh feed (what --resume builds)."""
    from tsync_mcore.rollout.feed import DataFeed
    cfg = rg_cfg(tmp_path, tiny_qwen2)
    first = DataFeed(cfg)
    order = [first.train.row(first.train_row(p)).prompt for p in range(20)]
    assert sorted(set(order)) == sorted({first.train.row(i).prompt for i in range(8)})
    for p in (0, 5, 8, 13):
        again = DataFeed(rg_cfg(tmp_path, tiny_qwen2))
        assert [again.train.row(again.train_row(q)).prompt for q in range(p, 20)] == order[p:]


@pytest.mark.parametrize("env, params, match", [
    ("reasoning_gym:basic_arithmetc", {},
     r"'rollout.env' \(reasoning_gym:basic_arithmetc\): reasoning-gym has no task "
     r"'basic_arithmetc' \(close names: basic_arithmetic"),
    ("reasoning_gym:zzzz", {}, r"no task 'zzzz' \(\d+ tasks, e.g. "),
    (f"reasoning_gym:{TASK}", {"max_term": 3},
     r"'reasoning_gym.params': task basic_arithmetic has no parameter 'max_term' \(its "
     r"parameters: min_terms, max_terms"),
    (f"reasoning_gym:{TASK}", {"min_terms": 0},
     r"'reasoning_gym.params': task basic_arithmetic refused \{'min_terms': 0\}: "
     r"AssertionError: min_terms must be positive"),
    (f"reasoning_gym:{TASK}", {"operators": ["^"]}, r"AssertionError: unsupported operator"),
])
def test_bad_task_or_params_are_one_line(tmp_path, tiny_qwen2, env, params, match):
    from tsync_mcore.rollout.feed import DataFeed
    cfg = rg_cfg(tmp_path, tiny_qwen2, **{"rollout.env": env, "reasoning_gym.params": params})
    with pytest.raises(DataError, match=match) as e:
        DataFeed(cfg)
    assert "\n" not in str(e.value)


def test_missing_package_is_one_line(tmp_path, tiny_qwen2, monkeypatch):
    from tsync_mcore.rollout.feed import DataFeed
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    with pytest.raises(DataError, match=r"'rollout.env' \(reasoning_gym:basic_arithmetic\): "
                                        r"the reasoning-gym package is not installed \(pip"):
        DataFeed(rg_cfg(tmp_path, tiny_qwen2))


@pytest.mark.parametrize("sets_, match", [
    ({"reasoning_gym.train_size": 0}, "'reasoning_gym.train_size': must be > 0, got 0"),
    ({"reasoning_gym.eval_size": -1}, "'reasoning_gym.eval_size': must be >= 0"),
    ({"reasoning_gym.eval_seed": 0}, r"'reasoning_gym.eval_seed': equals "
                                     r"reasoning_gym.train_seed \(0\)"),
    ({"reasoning_gym.eval_seed": 5}, r"'reasoning_gym.eval_seed': evaluation seeds 5..8 "
                                     r"overlap training seeds 0..7 .* use eval_seed >= 8"),
    ({"reasoning_gym.train_seed": -1}, "'reasoning_gym.train_seed': must be >= 0"),
    ({"reasoning_gym.params": {"seed": 3}}, r"'reasoning_gym.params': \['seed'\] is set by"),
    ({"reasoning_gym.params": [1, 2]}, "'reasoning_gym.params': must be a mapping"),
    ({"reasoning_gym.answer_tag": "<answer>"}, "'reasoning_gym.answer_tag': must be a tag"),
    ({"rollout.env": "reasoning_gym:"}, "'rollout.env': must be"),
    ({"data.train": "x.jsonl"}, "'data.train': rollout.env='reasoning_gym:basic_arithmetic' "
                                "generates its questions"),
    ({"reward.function": "math"}, "'reward.function': reasoning_gym:basic_arithmetic scores"),
    ({"reasoning_gym.eval_size": 0, "run.eval_every": 2},
     "'reasoning_gym.eval_size': run.eval_every=2 evaluates"),
])
def test_config_errors_name_their_key(tmp_path, sets_, match):
    base = {"rollout.env": f"reasoning_gym:{TASK}", "reasoning_gym.train_size": 8,
            "reasoning_gym.eval_size": 4}
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, {**base, **sets_})
    assert "\n" not in str(e.value)


def test_params_set_key_by_key_from_the_command_line():
    from tsync_mcore.config import parse_overrides
    cfg = load_config(None, parse_overrides([f"rollout.env=reasoning_gym:{TASK}",
                                             "reasoning_gym.params.max_terms=3",
                                             "reasoning_gym.params.operators=[+, -]"]))
    assert cfg.reasoning_gym.params == {"max_terms": 3, "operators": ["+", "-"]}


@pytest.mark.parametrize("task", ["spiral_matrix", "string_insertion", "binary_matrix",
                                  "n_queens"])
def test_tasks_that_eval_the_answer_read_it_as_data(task, tmp_path):
    """The tasks whose scorer `eval`s the answer get it read as a literal instead: the
    payload of issue 47 runs nothing (here, in-process; the jailed worker does the same),
    while literal answers (the answer, and its items as a Python list) score as the task's
    own eval scored them."""
    import sys

    import reasoning_gym

    from tsync_mcore.rewards.rgym import answers_as_data, literal
    ds = reasoning_gym.create_dataset(task, seed=0, size=2)
    e = ds[0]
    items = e["answer"].split() if task == "spiral_matrix" else list(e["answer"])
    honest = [e["answer"], str(items), str([i for i in items[:-1]])]
    module = sys.modules[type(ds).score_answer.__module__]
    vars(module).pop("eval", None)  # the task's own eval: the builtin
    want = [ds.score_answer(answer=a, entry=e) for a in honest]
    answers_as_data(ds)
    try:
        assert module.eval is literal
        assert [ds.score_answer(answer=a, entry=e) for a in honest] == want
        marker = tmp_path / "ran"
        payload = f"[__import__('os').system('touch {marker}')]"
        assert ds.score_answer(answer=payload, entry=e) == 0.0
        assert not marker.exists()
    finally:
        del module.eval  # other tests see the task as reasoning-gym ships it
