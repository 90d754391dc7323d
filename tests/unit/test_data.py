"""Dataset loading (JSONL, Parquet, save_to_disk), bad inputs, chat rendering, the epoch
sampler behind data_pos, and SkyRL-Gym envs fed from dataset rows."""

import asyncio

import numpy as np
import pytest

from tests.helpers.data_shared import gsm8k_rows, write_jsonl
from tsync_mcore.config import load_config
from tsync_mcore.data import (
    DataError,
    EpochSampler,
    PromptSet,
    render_prompt,
    row_messages,
)

ROWS = [
    {"prompt": "What is 2 + 3?", "label": "5", "source": "a", "level": 1},
    {"prompt": [{"role": "user", "content": "What is 7 * 6?"}], "label": "42", "source": "b",
     "level": 2},
    {"prompt": "Count to three.", "label": "one two three", "source": "c", "level": 3},
]


def chat_rows():
    # Arrow needs one type per column: chat-only rows for the three-format comparison.
    return [dict(r, prompt=r["prompt"] if isinstance(r["prompt"], list)
                 else [{"role": "user", "content": r["prompt"]}]) for r in ROWS]


@pytest.fixture
def tok(tiny_qwen2):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_qwen2)


def test_jsonl_parquet_and_save_to_disk_give_the_same_rows(tmp_path):
    import datasets
    rows = chat_rows()
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    sets = [PromptSet(p, "prompt", "label") for p in
            (jsonl, str(tmp_path / "d.parquet"), str(tmp_path / "disk"))]
    for ps in sets:
        assert len(ps) == 3
        for i, want in enumerate(rows):
            row = ps.row(i)
            assert row.index == i and row.prompt == want["prompt"] and row.label == want["label"]
            assert row.meta == {"source": want["source"], "level": want["level"]}


def test_string_prompts_and_a_dotted_label(tmp_path):
    rows = [{"question": "q1", "reward_model": {"ground_truth": "1", "style": "rule"}},
            {"question": "q2", "reward_model": {"ground_truth": "2", "style": "rule"}}]
    ps = PromptSet(write_jsonl(tmp_path / "d.jsonl", rows), "question",
                   "reward_model.ground_truth")
    assert [ps.row(i).label for i in range(2)] == ["1", "2"]
    assert ps.row(1).prompt == "q2" and ps.row(1).meta["reward_model"]["style"] == "rule"
    assert PromptSet(str(tmp_path / "d.jsonl"), "question", "").row(0).label is None


@pytest.mark.parametrize("case, match", [
    ("missing", "no such file or directory"),
    ("csv", "unknown data format"),
    ("no_prompt", "no column 'prompt' for the prompt"),
    ("no_label", "no column 'label' for the label"),
    ("empty", r"d.jsonl: empty file \(no rows\)$"),
    ("blank_json", r"d.json: empty file \(no rows\)$"),
    ("empty_list_json", r"d.json: no rows$"),
    ("surrogate", r"d.jsonl:3: row 1: column 'prompt' holds a lone UTF-16 surrogate"),
    ("surrogate_json", r"d.json: cannot read as json \(ArrowInvalid: .* in row 1\)$"),
    ("bad_json", r"d.jsonl:2: not valid JSON"),
    ("not_object", r"d.jsonl:1: each line must be a JSON object"),
    ("no_content", r"d.jsonl row 1: column 'prompt': message 0 has no 'content' string"),
    ("bad_role", r"row 0: column 'prompt': message 1 has role 'robot'"),
    ("empty_messages", r"row 0: column 'prompt': empty messages list"),
    ("empty_prompt", r"row 1: column 'prompt': empty prompt"),
    ("null_label", r"row 1: no label at 'label'"),
    ("dataset_dict", "a DatasetDict with splits"),
    ("plain_dir", "not one written by datasets"),
])
def test_bad_inputs_are_one_line_errors_naming_file_and_row(tmp_path, case, match):
    p = tmp_path / "d.jsonl"
    if case == "missing":
        p = tmp_path / "nope.jsonl"
    elif case == "csv":
        p = tmp_path / "d.csv"
        p.write_text("prompt,label\nx,y\n")
    elif case == "no_prompt":
        write_jsonl(p, [{"question": "x", "label": "y"}])
    elif case == "no_label":
        write_jsonl(p, [{"prompt": "x", "answer": "y"}])
    elif case == "empty":
        p.write_text("")
    elif case == "blank_json":
        p = tmp_path / "d.json"
        p.write_text("\n  \n")
    elif case == "empty_list_json":
        p = tmp_path / "d.json"
        p.write_text("[]\n")
    elif case in ("surrogate", "surrogate_json"):  # JSON's \\ud800 escape, unpaired
        p = p if case == "surrogate" else tmp_path / "d.json"
        p.write_text('{"prompt": "x", "label": "y"}\n\n{"prompt": "x\\ud800y", "label": "y"}\n')
    elif case == "bad_json":
        p.write_text('{"prompt": "x", "label": "y"}\n{"prompt": "x", "label": \n')
    elif case == "not_object":
        p.write_text('["prompt", "x"]\n')
    elif case == "no_content":
        write_jsonl(p, [{"prompt": [{"role": "user", "content": "a"}], "label": "y"},
                        {"prompt": [{"role": "user"}], "label": "y"}])
    elif case == "bad_role":
        write_jsonl(p, [{"prompt": [{"role": "user", "content": "a"},
                                    {"role": "robot", "content": "b"}], "label": "y"}])
    elif case == "empty_messages":
        write_jsonl(p, [{"prompt": [], "label": "y"}])
    elif case == "empty_prompt":
        write_jsonl(p, [{"prompt": "x", "label": "y"}, {"prompt": "  ", "label": "y"}])
    elif case == "null_label":
        write_jsonl(p, [{"prompt": "x", "label": "y"}, {"prompt": "x", "label": None}])
    elif case == "dataset_dict":
        import datasets
        p = tmp_path / "dd"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(p))
    elif case == "plain_dir":
        p = tmp_path / "somedir"
        p.mkdir()
    with pytest.raises(DataError, match=match) as e:
        PromptSet(str(p), "prompt", "label")
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_chat_rendering_matches_the_template_written_out(tmp_path, tok):
    ps = PromptSet(write_jsonl(tmp_path / "d.jsonl", chat_rows()), "prompt", "label")
    row = ps.row(1)
    ids = render_prompt(tok, row, system_prompt="Be brief.")
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 * 6?"
            "<|im_end|>\n<|im_start|>assistant\n")
    assert ids == tok(text, add_special_tokens=False).input_ids
    # a row's own system message wins over data.system_prompt
    own = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    from tsync_mcore.data import Row
    assert row_messages(Row(0, own, None), "Be brief.") == own
    # string prompts: one user message through the template, or the text as it is
    s = Row(0, "What is 2 + 3?", "5")
    assert render_prompt(tok, s) == tok("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                                        "<|im_start|>assistant\n",
                                        add_special_tokens=False).input_ids
    assert render_prompt(tok, s, "Sys", chat_template=False) == tok(
        "Sys\n\nWhat is 2 + 3?", add_special_tokens=False).input_ids
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        render_prompt(tok, s)


def test_sampler_permutes_each_epoch_and_resumes_at_any_position():
    n, seed = 7, 1234
    s = EpochSampler(n, seed)
    order = [s.index(p) for p in range(4 * n)]
    epochs = [order[e * n:(e + 1) * n] for e in range(4)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # each epoch: every row once
    assert len({tuple(e) for e in epochs}) == 4  # a new order every epoch
    for p in (0, 3, n, n + 5, 3 * n - 1):  # a fresh sampler at p: what a resumed run sees
        fresh = EpochSampler(n, seed)
        assert [fresh.index(q) for q in range(p, 4 * n)] == order[p:]
    # the permutation is numpy's PCG64 seeded with (seed, epoch), independent of history
    ref = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 2]))).permutation(n)
    assert epochs[2] == list(ref)
    assert [EpochSampler(n, seed + 1).index(p) for p in range(n)] != epochs[0]
    assert [EpochSampler(n, seed, shuffle=False).index(p) for p in range(2 * n)] == \
        list(range(n)) * 2


def feed_cfg(tmp_path, hf_dir, **sets):
    base = {"model.hf_dir": hf_dir, "run.dir": str(tmp_path / "run")}
    return load_config(None, {**base, **sets})


def test_skyrl_gsm8k_multi_turn_gets_its_row(tmp_path, tiny_qwen2, tok):
    """The README's skyrl:gsm8k_multi_turn crashed at its first episode (no reward_spec);
    fed from a SkyRL-layout dataset each env gets its row's ground truth."""
    from tsync_mcore.rollout.feed import DataFeed
    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows())
    cfg = feed_cfg(tmp_path, tiny_qwen2, **{"rollout.env": "skyrl:gsm8k_multi_turn",
                                            "data.train": data, "rollout.max_turns": 2,
                                            "rollout.max_total_tokens": 200})
    feed = DataFeed(cfg)
    feed.attach(tok)
    rows = [feed.train_row(p) for p in range(3)]
    assert sorted(rows) == [0, 1, 2]
    envs = feed.train_envs(rows, ["a", "b", "c"])
    for env, r in zip(envs, rows):
        ids = env.reset(seed=r)
        q = gsm8k_rows()[r]["prompt"][0]["content"]
        assert tok.decode(ids) == f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        answer = gsm8k_rows()[r]["reward_spec"]["ground_truth"]
        wrong = str(int(answer) + 1)
        obs, done = asyncio.run(env.step(tok(f"so #### {wrong}").input_ids))
        assert not done and "final numeric answer" in tok.decode(obs)  # turn 2 of 2
        obs, done = asyncio.run(env.step(tok(f"#### {answer}").input_ids))
        assert done and env.reward() == 1.0
    # a row for another env class is refused at start
    bad = [dict(gsm8k_rows()[0], env_class="aime")]
    cfg.data.train = write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(DataError, match=r"env_class \['aime'\]"):
        DataFeed(cfg)


def test_overlong_prompt_is_named_at_start(tmp_path, tiny_qwen2, tok):
    from tsync_mcore.rollout.feed import DataFeed
    # the last of 50 rows: every row is rendered at start, not only the first
    rows = [{"prompt": f"what is {i}?", "label": "x"} for i in range(49)]
    data = write_jsonl(tmp_path / "d.jsonl", rows + [{"prompt": "word " * 200, "label": "x"}])
    cfg = feed_cfg(tmp_path, tiny_qwen2, **{"rollout.env": "dataset", "data.train": data,
                                            "reward.function": "exact_match"})
    feed = DataFeed(cfg)
    with pytest.raises(DataError, match=r"d.jsonl row 49: prompt of \d+ tokens leaves no room"):
        feed.attach(tok)


def test_jsonl_labels_keep_the_type_they_have_in_the_file(tmp_path):
    """Arrow unifies a column's types ("4" among numbers became 4); the reward gets the
    file's own value."""
    labels = ["4", 5, [1, 2], {"a": "07"}, 2.5, True, "05"]
    rows = [{"prompt": f"q{i}", "label": v} for i, v in enumerate(labels)]
    ps = PromptSet(write_jsonl(tmp_path / "d.jsonl", rows), "prompt", "label")
    got = [ps.row(i).label for i in range(len(labels))]
    assert got == labels and [type(x) for x in got] == [type(x) for x in labels]


@pytest.mark.parametrize("sets, match", [
    ({"rollout.env": "dataset"}, "'data.train': rollout.env='dataset' takes its prompts"),
    ({"rollout.env": "dataset", "data.train": "x.jsonl"}, "'reward.function': rollout.env"),
    ({"reward.function": "a.b:"}, "'reward.function': 'a.b:' is neither"),
    ({"reward.function": "my file.txt:f"}, "neither a .py file nor a dotted module"),
    ({"reward.on_error": "ignore"}, "'reward.on_error': must be one of"),
    ({"run.eval_every": 2}, "'data.eval': run.eval_every=2"),
    ({"run.eval_first": True}, "'data.eval': run.eval_first evaluates"),
    ({"data.eval_n": 0}, "'data.eval_n': must be >= 1"),
    ({"rollout.env": "skyrl:gsm8k", "data.train": "x", "reward.function": "math"},
     "'reward.function': skyrl:gsm8k scores episodes itself"),
    ({"rollout.eval_temperature": -1}, "'rollout.eval_temperature'"),
])
def test_config_keys_are_checked_by_name(sets, match):
    from tsync_mcore.config import ConfigError
    with pytest.raises(ConfigError, match=match):
        load_config(None, sets)


def test_skyrl_reset_honours_its_seed(tok):
    """SkyRL envs take no seed; the adapter seeds Python's `random` around building and
    initialising the env, and leaves the caller's random stream as it was."""
    import random

    import skyrl_gym
    import skyrl_gym.envs
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    from tsync_mcore.data import Row
    from tsync_mcore.rollout.envs import SkyRLGymAdapter

    class Dice(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()
            self.face = random.randint(1, 10**9)

        def init(self, prompt):
            return [{"role": "user", "content": f"{prompt[0]['content']} {self.face}"}], {}

    skyrl_gym.register(id="tsync_test_dice", entry_point=Dice)
    try:
        env = SkyRLGymAdapter.from_row("tsync_test_dice", tok, Row(0, "roll", None))
        random.seed(7)
        before = random.getstate()
        a, b, c = env.reset(1), env.reset(1), env.reset(2)
        assert a == b and a != c and random.getstate() == before
    finally:
        skyrl_gym.envs.deregister("tsync_test_dice")
