"""Live: reward.function 'judge' — a tiny policy trained one update on a dataset, every answer
graded by a tiny judge model served by its own vLLM engine in the rollout process
(configs/judge_tiny.yaml).

One run (module-scoped): the judge is called once per trajectory, the rewards the learner
trained on (its trace's SourceRecord.reward) are the parser applied to the judge outputs
recorded in RUN/judge/records.jsonl (0 where none parses), and the judge metrics are in
metrics.jsonl and the console line. The config leaves reward.on_error at its default: the
unparseable verdicts of the random judge, and an evaluation row whose label makes its judge
prompt longer than the judge's context, are those trajectories' errors and the run goes on
(issue 47, finding 9). The judge engine's own failures (a timeout, a dead engine) run on
test_rollout.py's engine."""

import json
import os

import pytest

from tests.helpers.live_run import DIGIT_ROWS as ROWS
from tests.helpers.live_run import launch
from tests.helpers.paths import ROOT

CONFIG = os.path.join(ROOT, "configs/judge_tiny.yaml")
TINY = dict(arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2, kv_heads=1,
            intermediate=128)  # vLLM CPU: head_dim >= 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("judge_models")
    return (make_tiny_checkpoint(str(root / "policy"), seed=0, **TINY),
            make_tiny_checkpoint(str(root / "judge"), seed=1, **TINY))


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory, models):
    from tsync_mcore.observability import trace
    tmp = tmp_path_factory.mktemp("judge_run")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # evaluation row 1's label alone is longer than the judge's context (512 tokens)
    held = tmp / "eval.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in
                            [ROWS[0], {**ROWS[1], "label": "2.71828 " * 80}]))
    run = str(tmp / "run")
    # θ_1 is evaluated on 2 rows after the update: the judge grades after a publication too
    launch(CONFIG, run, [f"model.hf_dir={models[0]}", f"reward.judge.model_dir={models[1]}",
                         f"data.train={data}", f"data.eval={held}", "data.eval_max_prompts=2",
                         "data.eval_n=1", "run.eval_every=1"], nproc=1)
    with open(f"{run}/judge/records.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return dict(
        run=run,
        records=[r for r in records if not r["traj_id"].startswith("eval")],
        eval_records=[r for r in records if r["traj_id"].startswith("eval")],
        evals=[json.loads(line) for line in open(f"{run}/eval.jsonl")],
        metrics=[json.loads(line) for line in open(f"{run}/metrics.jsonl")],
        sources=trace.sources(trace.read_run(run)),
        console=open(f"{run}/learner.out").read())


def parsed(records):
    """traj_id → the reward the config's parser gives the recorded output (0: none)."""
    from tsync_mcore.config import load_config
    from tsync_mcore.rewards.judge import JudgeParseError, Parser
    parser = Parser.from_config(load_config(CONFIG).reward.judge)
    out = {}
    for rec in records:
        try:
            out[rec["traj_id"]] = parser(rec["output"], rec["answer"])
        except JudgeParseError:
            out[rec["traj_id"]] = 0.0
    return out


@pytest.mark.timeout(900)
def test_judge_scores_every_trajectory_once(judged_run):
    recs, sources = judged_run["records"], judged_run["sources"]
    trained = sorted(s.traj_id for s in sources)
    assert trained == [f"v0-g{g}-t{i}" for g in range(2) for i in range(3)]  # 2 groups × 3
    assert sorted(r["traj_id"] for r in recs) == trained  # one judge call each, no more
    for r in recs:
        assert r["prompt_tokens"] > 0 and r["finish_reason"] in ("stop", "length")
        assert r["where"].startswith(f"trajectory {r['traj_id']} (")


@pytest.mark.timeout(900)
def test_learner_trained_on_the_parsed_judge_outputs(judged_run):
    recs, sources = judged_run["records"], judged_run["sources"]
    want = parsed(recs)
    assert {s.traj_id: s.reward for s in sources} == pytest.approx(want, abs=1e-12)
    for r in recs:  # the record's own reward and error agree with the parse
        assert (r["reward"] is None) == (r["error"] is not None)
        if r["error"] is not None:
            assert "cannot score the judge's output" in r["error"] and want[r["traj_id"]] == 0.0
    # the tiny random judge writes a digit sometimes: both paths ran (seeded, so stable)
    assert any(r["reward"] is not None for r in recs), [r["output"] for r in recs]
    assert len({round(v, 9) for v in want.values()}) >= 2, want
    (row,) = judged_run["metrics"]
    assert row["reward_mean"] == pytest.approx(sum(want.values()) / len(want), abs=1e-12)


@pytest.mark.timeout(900)
def test_judge_is_frozen_and_grades_evaluation(judged_run):
    """θ_1's evaluation ran after the publication reached the policy's engine; the judge
    engine still serves its own weights (version 0), and its calls are counted apart."""
    ev = judged_run["eval_records"]
    assert sorted(r["traj_id"] for r in ev) == ["eval1-r0-s0", "eval1-r1-s0"]
    assert {r["judge_version"] for r in judged_run["records"] + ev} == {0}
    (e,) = judged_run["evals"]
    assert e["eval/policy_version"] == 1 and e["eval/reward_judge_calls"] == 2
    want = parsed(ev)
    assert e["eval/reward_mean"] == pytest.approx(sum(want.values()) / 2, abs=1e-12)


@pytest.mark.timeout(900)
def test_an_answer_the_judge_cannot_hold_is_its_trajectorys_error(judged_run):
    """Evaluation row 1's judge prompt exceeds the judge's context: that sample is scored 0
    under the default reward.on_error, named in one line, never sent to the judge engine,
    and the run went on (its metrics, its evaluation)."""
    by = {r["traj_id"]: r for r in judged_run["eval_records"]}
    long = by["eval1-r1-s0"]
    assert long["reward"] is None and long["output"] == "" and long["prompt_tokens"] > 512
    assert long["error"].startswith("reward judge ") and "\n" not in long["error"]
    assert long["error"].endswith("exceed the judge's context (512 tokens): the answer (" +
                                  f"{len(long['answer'])} characters) is not judged")
    (e,) = judged_run["evals"]
    assert e["eval/reward_judge_too_long"] == 1 and e["eval/reward_judge_engine_errors"] == 0
    assert e["eval/reward_errors"] == 1 + (by["eval1-r0-s0"]["error"] is not None)
    assert len(judged_run["metrics"]) == 1  # the update's line: the run finished


@pytest.mark.timeout(900)
def test_judge_metrics_in_the_metrics_line(judged_run):
    recs = judged_run["records"]
    (row,) = judged_run["metrics"]
    failures = sum(r["error"] is not None for r in recs)
    assert row["reward/judge_calls"] == 6 and row["reward/judge_parse_failures"] == failures
    assert row["reward/errors"] == failures and row["reward/judge_timeouts"] == 0
    assert row["reward/judge_engine_errors"] == 0 and row["reward/judge_too_long"] == 0
    assert 0 < row["reward/judge_s"] <= row["rollout_time_s"]
    assert 1 <= row["reward/judge_in_flight_max"] <= 6
    assert "reward/judge_calls:6" in judged_run["console"]
