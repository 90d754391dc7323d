"""A run directory used twice: a fresh run replaces the earlier run's records, a resume keeps
those up to its checkpoint (tsync_mcore/observability/run_files.py), so `predict trace` and the report see
one run per update."""

import json
import os
import shutil

from tests.helpers.scripted import (
    run_scripted,  # golden (conftest.py): the single-run baseline
)
from tsync_mcore.observability import predict, run_files, trace
from tsync_mcore.observability.trace import SourceRecord, UpdateRecord


def lines(path):
    return [json.loads(x) for x in open(path)]


def test_keep_until_drops_updates_after_the_checkpoint(tmp_path):
    run = str(tmp_path)
    os.makedirs(tmp_path / "traces")
    recs = [r for u in range(4) for r in
            (SourceRecord(update=u, rank=0, source="trajectory", traj_id=f"t{u}", group_id="g",
                          turn=None, policy_version=u, scored_tokens=3, ready=0.1, start=0.1,
                          end=0.2),
             UpdateRecord(update=u, rank=0, objective="grpo", schedule="sync", n_groups=1,
                          n_sources=1, scored_tokens=3))]
    trace.write(str(tmp_path / "traces" / "rank0.jsonl"), recs)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (1, 2):
            f.write(json.dumps(dict(step=step, policy_version=step - 1, ok=True)) + "\n")
        f.write(json.dumps(dict(step=2, policy_version=2, ok=False, skipped="nan")) + "\n")
        f.write(json.dumps(dict(step=3, policy_version=2, ok=True)) + "\n")
        f.write('{"step": 4, "policy_ver')  # a line the crash cut off
    with open(tmp_path / "nvml_rank0.jsonl", "w") as f:
        for t in (10.0, 20.0, 30.0):
            f.write(json.dumps(dict(t_wall=t, t_perf=t, util_gpu=50)) + "\n")
    with open(tmp_path / "eval.jsonl", "w") as f:  # the rollout's evaluations of θ_2, θ_4
        for v in (2, 4):
            f.write(json.dumps({"eval/policy_version": v, "eval/reward_mean": 0.5}) + "\n")

    # checkpoint of θ_2, written at t=25: updates 0 and 1 made it, 2 and 3 are redone
    dropped = run_files.keep_until(run, 0, version=2, checkpoint_time=25.0)
    kept = trace.read(str(tmp_path / "traces" / "rank0.jsonl"))
    assert sorted({r.update for r in kept}) == [0, 1] and len(kept) == 4
    assert [(m["step"], m["ok"]) for m in lines(tmp_path / "metrics.jsonl")] == \
        [(1, True), (2, True)]
    assert [s["t_wall"] for s in lines(tmp_path / "nvml_rank0.jsonl")] == [10.0, 20.0]
    assert [e["eval/policy_version"] for e in lines(tmp_path / "eval.jsonl")] == [2]
    assert dropped == 4 + 3 + 1 + 1
    assert run_files.keep_until(run, 0, version=2, checkpoint_time=25.0) == 0  # idempotent

    # a fresh run: rank 1 removes only its own files, rank 0 the rest (ranks 2, 3 of an
    # earlier, larger run included)
    trace.write(str(tmp_path / "traces" / "rank3.jsonl"), recs[:2])
    os.makedirs(tmp_path / "tensorboard")
    events = os.path.join("tensorboard", "events.out.tfevents.1.host.1.0")
    open(tmp_path / events, "wb").close()
    assert run_files.start_fresh(run, 1) == []
    removed = run_files.start_fresh(run, 0)
    assert removed == ["eval.jsonl", "metrics.jsonl", "nvml_rank0.jsonl", events,
                       os.path.join("traces", "rank0.jsonl"),
                       os.path.join("traces", "rank3.jsonl")]
    assert os.listdir(tmp_path / "traces") == [] == os.listdir(tmp_path / "tensorboard")


def per_rank_updates(run):
    out = {}
    for r in trace.read_run(run):
        if isinstance(r, UpdateRecord):
            out.setdefault((r.rank, r.update), 0)
            out[(r.rank, r.update)] += 1
    return out


def test_second_run_in_one_dir_predicts_like_a_single_run(tiny_qwen2, golden, tmp_path):
    # the first run: a copy of the golden one (run_scripted, 2 updates, same config)
    run = str(tmp_path / "run")
    shutil.copytree(golden["run"], run)
    first = {r: open(os.path.join(run, "traces", f"rank{r}.jsonl")).read() for r in (0, 1)}
    rc, _, err, _ = run_scripted(tiny_qwen2, run, updates=2)
    assert rc == 0, err[-4000:]
    assert "fresh run: replaced metrics.jsonl" in err
    single = predict.analyze_run(golden["run"], warmup=0)
    twice = predict.analyze_run(run, warmup=0)
    assert [u["step"] for u in twice["updates"]] == [1, 2]
    # the same learner work per update as one run
    assert [u["n_jobs"] for u in twice["updates"]] == [u["n_jobs"] for u in single["updates"]]
    assert per_rank_updates(run) == {(r, u): 1 for r in (0, 1) for u in (0, 1)}
    # what appending did (the second run's records after the first's): every update's work
    # counted twice, and the predicted step, hence the error, inflated
    appended = tmp_path / "appended"
    (appended / "traces").mkdir(parents=True)
    shutil.copy(os.path.join(run, "metrics.jsonl"), appended / "metrics.jsonl")
    for r in (0, 1):
        second = open(os.path.join(run, "traces", f"rank{r}.jsonl")).read()
        (appended / "traces" / f"rank{r}.jsonl").write_text(first[r] + second)
    # (P = publication only: the full suffix infers the optimizer time from the last job's
    # end, which the extra records move too)
    both = predict.analyze_run(str(appended), warmup=0, suffix="publish")
    alone = predict.analyze_run(run, warmup=0, suffix="publish")
    for u, a, v in zip(alone["updates"], both["updates"], single["updates"]):
        assert a["n_jobs"] == 2 * v["n_jobs"] == 2 * u["n_jobs"]
        # c_n may stay: a lane whose last job is released after its other work is done
        # ends at that release + service however many earlier jobs fill its idle gaps
        assert a["L_total"] > u["L_total"] and a["c_n"] >= u["c_n"]
        # T = max(R, c_n) + P: larger unless the rollout alone outlasts both lanes
        assert a["T_thundersync"] >= u["T_thundersync"]
        assert a["prediction_error_pct"] >= u["prediction_error_pct"]
    print("prediction error % per update: this run", [round(u["prediction_error_pct"], 1)
          for u in alone["updates"]], "appended", [round(u["prediction_error_pct"], 1)
                                                   for u in both["updates"]])

    # a resume from θ_1: the records of update 1 (step 2) were not checkpointed and go
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write("step_1")
    rc, _, err, _ = run_scripted(tiny_qwen2, run, updates=2, flags=("--resume",))
    assert rc == 0, err[-4000:]
    assert "resume at policy version 1: dropped" in err
    assert [m["step"] for m in lines(os.path.join(run, "metrics.jsonl"))] == [1, 2]
    assert per_rank_updates(run) == {(r, u): 1 for r in (0, 1) for u in (0, 1)}
    resumed = predict.analyze_run(run, warmup=0)
    assert [u["n_jobs"] for u in resumed["updates"]] == [u["n_jobs"] for u in single["updates"]]
