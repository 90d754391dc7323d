"""perf/studies/figure1.py's summaries, checks and report on synthetic run directories (no run)."""

from __future__ import annotations

import json
import os

import pytest

from perf.studies import figure1
from tsync_mcore.observability import trace
from tsync_mcore.observability.trace import SourceRecord, UpdateRecord

R, SERVICE, PUBLISH, OPTIMIZER = 1.0, 0.25, 0.1, 0.2
READY = (0.2, 0.4, 0.6, 0.8)  # four sources per update, two groups of two


def _sources(u: int, schedule: str, tokens: str, gap: float) -> list[SourceRecord]:
    """Sync serves after the close (R); the others as each source arrives (`gap`: a lane
    that waited that long before serving)."""
    out, t = [], R if schedule == "sync" else 0.0
    sampled = max(u - 1, 0) if schedule == "one_step_off" else u
    for i, ready in enumerate(READY):
        start = max(t, ready + gap) if schedule != "sync" else t
        out.append(SourceRecord(
            update=u, rank=0, source="trajectory", traj_id=f"v{u}-g{i // 2}-t{i % 2}",
            group_id=f"v{u}-g{i // 2}", turn=None, policy_version=sampled, scored_tokens=8,
            ready=ready, policy_lag=u - sampled, start=start, end=start + SERVICE, cpu=SERVICE,
            fold="direct", span_tokens=16, logits=True, tokens_sha256=f"{tokens}{u}-{i}"))
        t = start + SERVICE
    return out


def write_run(d, schedule: str, rewards: list[float], tokens: str = "a", gap: float = 0.0,
              evals: tuple[int, ...] = ()) -> str:
    run = os.path.join(d, schedule)
    os.makedirs(os.path.join(run, "traces"))
    rows, records = [], []
    for u, reward in enumerate(rewards):
        src = _sources(u, schedule, tokens, gap)
        last_end = max(s.end for s in src)
        lag = float(src[0].policy_lag)
        records += src + [UpdateRecord(update=u, rank=0, objective="grpo", schedule=schedule,
                                       n_groups=2, n_sources=4, scored_tokens=32)]
        rows.append(dict(step=u + 1, policy_version=u, ok=True, schedule=schedule,
                         step_wall_time_s=max(R, last_end) + OPTIMIZER + PUBLISH,
                         rollout_time_s=R, learner_tail_s=max(0.0, last_end - R) + OPTIMIZER,
                         publish_time_s=PUBLISH, reward_mean=reward, policy_lag_mean=lag,
                         policy_lag_max=int(lag)))
    trace.write(os.path.join(run, "traces", "rank0.jsonl"), records, mode="w")
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(run, "eval.jsonl"), "w") as f:
        f.writelines(json.dumps({"eval/policy_version": v, "eval/pass@1": 0.25 * v,
                                 "eval/reward_mean": 0.25 * v}) + "\n" for v in evals)
    return run


def runs(tmp_path, ts_tokens: str = "a", ts_gap: float = 0.0) -> dict[str, figure1.Run]:
    rewards = [0.25, 0.5, 0.75]
    dirs = {"sync": write_run(tmp_path, "sync", rewards, evals=(0, 3)),
            "thundersync": write_run(tmp_path, "thundersync", rewards, ts_tokens, ts_gap,
                                     evals=(0, 3)),
            "one_step_off": write_run(tmp_path, "one_step_off", [0.25, 0.25, 0.5])}
    return {s: figure1.read_run(s, d) for s, d in dirs.items()}


def test_per_update_figures_from_metrics_trace_and_evaluations(tmp_path):
    r = runs(tmp_path)
    sync, ts = figure1.updates(r["sync"]), figure1.updates(r["thundersync"])
    assert [u["step"] for u in sync] == [1, 2, 3]
    # sync serves the four sources after the close: 1 s of work after the last arrival
    assert sync[0]["trace_tail_s"] == pytest.approx(R + 4 * SERVICE - READY[-1])
    assert sync[0]["step_s"] == pytest.approx(2.3) and sync[-1]["clock_s"] == pytest.approx(6.9)
    # streamed: the lane, 0.05 s behind each arrival, has 0.4 s left after the last one
    assert ts[0]["trace_tail_s"] == pytest.approx(READY[0] + 4 * SERVICE - READY[-1])
    assert [u["eval_pass1"] for u in ts] == [None, None, 0.75]  # θ_3 evaluated after update 3
    assert figure1.evaluations(r["sync"])[0] == dict(version=0, pass1=0.0, reward=0.0)


def test_speedups_over_the_paired_sync_trace(tmp_path):
    r = runs(tmp_path)
    sp = figure1.speedup(r["sync"], r["thundersync"], warmup=1)
    assert sp["updates"] == [2, 3]
    assert sp["measured"] == pytest.approx(2.3 / 1.5)
    assert sp["predicted"] == pytest.approx(2.3 / 1.5)  # the lane served as the replay does
    assert sp["predicted_same_service"] == pytest.approx(2.3 / 1.5)
    osf = figure1.speedup(r["sync"], r["one_step_off"], warmup=1)
    assert osf["predicted"] > 1 and osf["predicted_same_service"] is None
    # a lane that waited after each arrival: the replay serves without the wait
    slow = runs(tmp_path / "slow", ts_gap=0.2)["thundersync"]
    sp = figure1.speedup(r["sync"], slow, warmup=1)
    assert sp["measured"] < sp["predicted"] and sp["measured_over_predicted"] < 0.95


def test_checks_same_policy_tokens_lags_and_speedups(tmp_path):
    summary = figure1.summarize(runs(tmp_path), warmup=1)
    assert summary["tokens_first_differ_at"] is None
    found = figure1.checks(summary)
    assert [ok for ok, _ in found] == [True, True, True, False]
    assert found[0][1].startswith("sync vs thundersync: equal reward in all 3 updates; "
                                  "sampled tokens identical")
    assert found[1][1] == "thundersync lag 0 in every update; one_step_off lag 1 from update 2 on"
    # one_step_off's measured step here holds its whole rollout, which the segment replay
    # overlaps with the learner: below its prediction
    assert found[2][1].startswith("thundersync: measured") and "100 %" in found[2][1]
    assert found[3][1].startswith("one_step_off: measured")

    parted = figure1.summarize(runs(tmp_path / "b", ts_tokens="b"), warmup=1)
    assert parted["tokens_first_differ_at"] == 1
    ok, what = figure1.checks(parted)[0]
    assert ok and "first differ in the batch of update 1" in what

    parted["schedules"]["thundersync"]["updates"][2]["reward"] = 0.0
    parted["schedules"]["one_step_off"]["updates"][0]["lag_mean"] = 1.0
    verdicts = figure1.checks(parted)
    assert not verdicts[0][0] and "reward differs from update 3 on" in verdicts[0][1]
    assert not verdicts[1][0]


def test_report_writes_results_and_table(tmp_path, capsys, monkeypatch):
    runs(tmp_path)
    drawn = []  # matplotlib takes seconds to import here: the tiny live run draws for real
    monkeypatch.setattr(figure1, "plots", lambda summary, out: drawn.append(summary) or [])
    assert figure1.main(["--report-only", "--out", str(tmp_path),
                         "--schedules", "sync,thundersync,one_step_off"]) == 0
    out = capsys.readouterr().out
    assert "| thundersync | 1.50 |" in out and "\nok sync vs thundersync" in out
    assert "\nFAIL one_step_off: measured speedup" in out
    doc = json.load(open(tmp_path / "results.json"))
    assert [c["ok"] for c in doc["checks"]] == [True, True, True, False]
    assert (tmp_path / "summary.md").read_text() in out
    assert drawn[0]["schedules"]["sync"]["evals"][-1] == dict(version=3, pass1=0.75, reward=0.75)


@pytest.mark.parametrize("argv, says", [
    (["--schedules", "thundersync"], "sync missing"),
    (["--schedules", "sync,nope"], "--schedules: nope"),
    (["--updates", "0"], "--updates must be >= 1"),
    (["--report-only"], "no "),
    (["--config", "/does/not/exist"], "--config: /does/not/exist is not a file"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, says):
    assert figure1.main(["--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: figure1: ") and says in err and err.count("\n") == 1
