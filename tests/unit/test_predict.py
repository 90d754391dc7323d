"""Speedup predictor: trace replay (Eq. 14-17) and analytic release laws (Eq. 19-28) against
hand-computed answers and every figure quoted in the paper's appendix F.6."""

from __future__ import annotations

import json
import os
import random

import pytest

from tests.helpers.predict_shared import REPO, close_to, write_run
from tests.helpers.records import deferred, source
from tsync_mcore.observability.predict import (
    ReleaseParams,
    analytic,
    analyze_run,
    jobs_by_rank,
    lane_completion,
    lane_completion_closed_form,
    main,
    peak_ratio,
    predict_update,
    release_grpo,
    release_opd,
    replay_lane,
    speedup_waves,
    tail_grpo,
    tail_opd,
)


def S(objective: str, batch: float, ratio: float, turns: int = 40) -> float:
    return analytic(objective, batch, ratio, turns)["speedup"]


def test_single_lane_back_to_back() -> None:
    jobs = [(0.0, 1.0), (2.0, 1.0), (2.5, 1.0)]  # c = 1, 3, 4
    assert lane_completion(jobs) == pytest.approx(4.0)
    assert replay_lane(jobs, R=4.0, P=0.5) == pytest.approx(4.5)
    assert replay_lane(list(reversed(jobs)), R=4.0, P=0.5) == pytest.approx(4.5)  # readiness order


def test_idle_gaps_and_rollout_bound() -> None:
    jobs = [(1.0, 0.5), (3.0, 0.5)]  # c = 1.5 then an idle gap, 3.5
    assert lane_completion(jobs) == pytest.approx(3.5)
    assert replay_lane(jobs, R=5.0, P=0.25) == pytest.approx(5.25)  # T = max(R, c_n) + P
    pred = predict_update([source(ready=t, start=t, end=t + p, rank=0) for t, p in jobs], 5.0, 0.25)
    assert pred["T_sync"] == pytest.approx(5.0 + 1.0 + 0.25)
    assert pred["lam"] == 0.0 and pred["tail_s"] == 0.0


def test_job_ready_after_rollout() -> None:
    # a source stamped ready after R extends the lane: c = 1, then 6 + 2 = 8
    entries = [source(ready=0.0, start=0.0, end=1.0), source(ready=6.0, start=6.0, end=8.0)]
    pred = predict_update(entries, R=5.0, P=1.0)
    assert pred["c_n"] == pytest.approx(8.0)
    assert pred["T_thundersync"] == pytest.approx(9.0)
    assert pred["T_sync"] == pytest.approx(5.0 + 3.0 + 1.0)  # Eq. 16
    assert pred["lam"] == pytest.approx(0.6)
    assert pred["speedup"] == pytest.approx(1.0)


def test_service_comes_from_end_minus_start_not_from_schedule() -> None:
    # a Sync-run trace: everything served after close; the replay releases at τ_j instead
    entries = [source(ready=1.0, start=4.0, end=6.0), source(ready=2.0, start=6.0, end=7.0)]
    pred = predict_update(entries, R=3.0, P=0.5)
    assert pred["c_n"] == pytest.approx(4.0)  # 1 + 2 = 3, max(2, 3) + 1 = 4
    assert pred["T_thundersync"] == pytest.approx(4.5)
    assert pred["T_sync"] == pytest.approx(3.0 + 3.0 + 0.5)
    assert pred["speedup"] == pytest.approx(6.5 / 4.5)
    assert pred["speedup"] == pytest.approx(
        (1 + pred["rho"] + pred["kappa"]) / (1 + pred["lam"] + pred["kappa"]))  # Eq. 16


def test_slow_rank_determines_step() -> None:
    e = [source(rank=0, ready=0.0, start=0.0, end=3.0),
         source(rank=0, ready=3.5, start=3.5, end=6.5),
         source(rank=1, ready=1.0, start=1.0, end=2.0)]
    pred = predict_update(e, R=5.0, P=0.5)
    assert pred["slow_rank"] == 0 and pred["ranks"] == [0, 1]
    assert pred["lane_end"] == {"0": pytest.approx(6.5), "1": pytest.approx(2.0)}
    assert pred["T_thundersync"] == pytest.approx(7.0)
    assert pred["L"] == pytest.approx(6.0) and pred["L_total"] == pytest.approx(7.0)
    assert pred["T_sync"] == pytest.approx(5.0 + 6.0 + 0.5)
    # a pooled lane would serialise rank 1's job behind rank 0's: 3, 4, 7.5
    assert lane_completion([(0.0, 3.0), (1.0, 1.0), (3.5, 3.0)]) == pytest.approx(7.0)


def test_opd_deferred_replay_ready_at_trajectory_completion() -> None:
    # Sync trace: turns served after close at 10; deferred replay recorded at its start (12)
    e = [source(turn=0, traj_id="a", rank=0, ready=1.0, start=10.0, end=11.0),
         source(turn=1, traj_id="a", rank=0, ready=4.0, start=11.0, end=12.0),
         deferred(work="replay", traj_id="a", rank=0, ready=12.0, start=12.0, end=14.0),
         source(turn=0, traj_id="b", rank=0, ready=4.0, start=14.0, end=14.5),
         source(turn=0, traj_id="c", rank=1, ready=2.0)]  # never served: no learner work
    lanes = jobs_by_rank(e)
    assert list(lanes) == [0]
    # replay inherits a's last turn readiness (4); at equal τ deferred work follows turns
    assert lanes[0] == [(1.0, 1.0), (4.0, 1.0), (4.0, 0.5), (4.0, 2.0)]
    pred = predict_update(e, R=5.0, P=0.0)
    assert pred["c_n"] == pytest.approx(7.5)  # 2, 5, 5.5, 7.5
    assert pred["T_thundersync"] == pytest.approx(7.5) and pred["n_jobs"] == 4


def test_empty_update() -> None:
    pred = predict_update([], R=2.0, P=0.5)
    assert pred["T_thundersync"] == pred["T_sync"] == pytest.approx(2.5)
    assert pred["speedup"] == pytest.approx(1.0)


def _random_jobs(rng: random.Random, n: int, R: float) -> list[tuple[float, float]]:
    return [(rng.uniform(0, R), rng.expovariate(1.0 / rng.uniform(0.05, 1.0))) for _ in range(n)]


def test_closed_form_bound_and_eq16_on_random_traces() -> None:
    rng = random.Random(0)
    for _ in range(300):
        R, P = rng.uniform(0.5, 10), rng.uniform(0, 2)
        jobs = _random_jobs(rng, rng.randint(1, 40), R)
        assert lane_completion(jobs) == pytest.approx(lane_completion_closed_form(jobs))  # Eq. 15
        entries = [source(rank=rng.randint(0, 2), ready=t, start=t, end=t + p) for t, p in jobs]
        pred = predict_update(entries, R, P)
        assert 1.0 - 1e-12 <= pred["speedup"] <= 2.0 + 1e-12  # Eq. 17
        assert pred["speedup"] == pytest.approx(
            (1 + pred["rho"] + pred["kappa"]) / (1 + pred["lam"] + pred["kappa"]))  # Eq. 16
        # Eq. 19 on the finite trace (strict-before F−) equals the replayed tail
        L = sum(p for _, p in jobs)
        rho = L / R
        sup = max([1.0] + [t / R + rho * (1 - sum(p for s, p in jobs if s < t) / L)
                           for t, _ in jobs])
        assert max(0.0, lane_completion(jobs) - R) / R == pytest.approx(sup - 1.0)


def test_speedup_two_at_exact_balance() -> None:
    # uniform releases, service equal to rollout, tail one infinitesimal job: S → 2
    n, R = 1000, 1.0
    jobs = [((j + 1) / n, 1.0 / n) for j in range(n)]
    pred = predict_update([source(ready=t, start=t, end=t + p) for t, p in jobs], R, 0.0)
    assert pred["speedup"] == pytest.approx(2.0 / (1.0 + 1.0 / n))


def test_discretized_release_law_within_eq27() -> None:
    # n equal-service atoms at F_GRPO's midpoint quantiles: |λ_trace − λ| ≤ ρ/(2n) (Eq. 27)
    for rho, n in ((1.0, 50), (1.5, 200), (0.8, 100)):
        def quantile(q: float) -> float:
            lo, hi = 0.0, 1.0
            for _ in range(80):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if release_grpo(mid, 8, 0.02, 0.49) < q else (lo, mid)
            return (lo + hi) / 2
        jobs = [(quantile((i + 0.5) / n), rho / n) for i in range(n)]
        lam_trace = max(0.0, lane_completion(jobs) - 1.0)
        assert abs(lam_trace - tail_grpo(rho)) <= rho / (2 * n) + 1e-9


def test_release_laws_shape() -> None:
    for u in (0.0, 0.3, 1.0):
        assert release_grpo(u, 8, 0.02, 0.49) == pytest.approx(0.98 * u ** 1.49 + 0.02 * u ** 8.49)
    assert release_opd(1.0, 10, 0.45, 0.49) == pytest.approx(1.0)
    assert release_opd(1.0, 1, 0.45, 0.49) == pytest.approx(1.0)
    assert release_opd(0.4, 1, 0.45, 0.49) == pytest.approx(0.4 ** 1.49)  # a = 1: u^{γ+1}
    # GRPO zero-tail condition ρ[γ+1+β(m−1)] ≤ 1 (F.2)
    edge = 1.0 / (1.49 + 0.02 * 7)
    assert tail_grpo(edge * 0.999) == 0.0 and tail_grpo(edge * 1.01) > 0.0


def test_tails_match_dense_grid() -> None:
    grid = [i / 20000 for i in range(20001)]
    for rho in (0.7, 1.0, 1.6, 2.9):
        g = max(u + rho * (1 - release_grpo(u, 8, 0.02, 0.49)) for u in grid) - 1
        assert tail_grpo(rho) == pytest.approx(max(g, 0.0), abs=1e-7)
        for a in (1, 3, 10):
            g = max(u + rho * (1 - release_opd(u, a, 0.45, 0.49)) for u in grid[::4]) - 1
            assert tail_opd(rho, a) == pytest.approx(max(g, 0.0), abs=1e-5)
            assert tail_opd(rho, a) >= max(g, 0.0) - 1e-12


def test_eq26_forms() -> None:
    # balance: (2w + κ)/(w + κ + λ); large w: (1+ρ)/max(1,ρ); never above 2 (Eq. 17)
    assert speedup_waves(1.0, 0.15, 0.05, 3.0) == pytest.approx(6.05 / 3.2)
    for rho in (0.25, 0.5, 2.0, 4.0):
        lam = tail_grpo(rho)
        limit = (1 + rho) / max(1, rho)
        assert speedup_waves(rho, lam, 0.05, 1e7) == pytest.approx(limit, rel=1e-6)
    for obj in ("grpo", "opd"):
        for B in (32, 64, 128, 300, 2048):
            for r in (0.3, 0.7, 1.0, 1.3, 4.0):
                assert S(obj, B, r) <= 2.0


# Every figure quoted in appendix F.6 (paper value, rounded to 2 decimals unless stated).
def test_f6_grpo_at_balance() -> None:
    assert close_to(S("grpo", 256, 1.0), 1.84)  # 1.8394
    assert close_to(S("grpo", 2048, 1.0), 1.98)  # 1.9782


def test_f6_opd_at_balance() -> None:
    for a in (10, 15, 20, 30, 40, 60, 100, 150, 200, 300):  # "1.97 to 1.98x at 256"
        assert 1.97 - 0.005 <= S("opd", 256, 1.0, a) <= 1.98 + 0.005
        assert close_to(S("opd", 2048, 1.0, a), 2.00)  # "2.00x at 2,048"
    # "from 1.967x at 10 turns to 1.975x at 300 turns" (3 decimals)
    assert abs(S("opd", 256, 1.0, 10) - 1.967) <= 0.0005
    assert abs(S("opd", 256, 1.0, 300) - 1.975) <= 0.0005


def test_f6_grpo_flat_in_turns_and_opd_improves_with_turns() -> None:
    assert S("grpo", 256, 1.0, 10) == S("grpo", 256, 1.0, 300)
    vals = [S("opd", 256, 1.0, a) for a in (1, 4, 10, 20, 100, 300)]
    assert vals == sorted(vals)


@pytest.mark.parametrize("ratios,lo,hi", [((0.5, 2.0), 1.46, 1.50),   # halving or doubling
                                          ((0.35, 2.8), 1.34, 1.36),
                                          ((4.0,), 1.24, 1.25)])
def test_f6_away_from_balance(ratios: tuple[float, ...], lo: float, hi: float) -> None:
    # "For B ≥ Q ... for both objectives": B from one wave (128) to 2048, horizons 10-300
    vals = [S(obj, B, r, a) for obj in ("grpo", "opd") for B in (128, 256, 512, 1024, 2048)
            for r in ratios for a in (10, 40, 300)]
    assert lo - 0.005 <= min(vals) and max(vals) <= hi + 0.005
    assert close_to(min(vals), lo) and close_to(max(vals), hi)  # the quoted range is attained


def test_f6_full_overlap_limit_symmetric_in_log_r() -> None:
    for r in (0.35, 0.5, 2.0 / 3.0):
        a, b = analytic("grpo", 1024, r), analytic("grpo", 1024, 1.0 / r)
        assert a["full_overlap_limit"] == pytest.approx(b["full_overlap_limit"])


def test_f6_peaks_near_balance_for_full_waves() -> None:
    for obj in ("grpo", "opd"):
        for B in (256, 1024, 2048):
            r, _ = peak_ratio(obj, B, 40)
            assert 0.95 <= r <= 1.05


def test_f6_small_batch_peak() -> None:
    # "at B = 64 the peak sits near r = 0.5, with 1.71x for GRPO and 1.95x for OPD"
    r, s = peak_ratio("grpo", 64, 40)
    assert 0.45 <= r <= 0.6 and close_to(s, 1.71) and close_to(S("grpo", 64, 0.5), 1.71)
    r, s = peak_ratio("opd", 64, 40)  # at the batch sweep's 40 turns (F.5)
    assert 0.45 <= r <= 0.55 and close_to(s, 1.95) and close_to(S("opd", 64, 0.5, 40), 1.95)
    for a in (10, 300):  # over Figure 10's horizons: 1.943 (10 turns) to 1.952 (300)
        assert abs(peak_ratio("opd", 64, a)[1] - 1.95) <= 0.01


def test_custom_params() -> None:
    p = ReleaseParams(capacity=64, group_size=4, beta=0.0, gamma=0.0, kappa_w=0.0)
    res = analytic("grpo", 64, 1.0, 1, p)
    # γ = β = 0: F(u) = u, no lag, no tail, no suffix: exactly 2x
    assert res["tail"] == pytest.approx(0.0, abs=1e-12) and res["speedup"] == pytest.approx(2.0)


def test_analyze_run_known_answer(tmp_path) -> None:
    res = analyze_run(write_run(tmp_path), warmup=1)
    assert res["n_updates"] == 3 and res["n_steady"] == 2
    u0 = res["updates"][0]
    # step_s = t_stepped − last_end = 5.0 − 4.6 = 0.4; P = 0.5 + 0.4
    assert u0["step_s"] == pytest.approx(0.4) and u0["P"] == pytest.approx(0.9)
    assert u0["T_thundersync"] == pytest.approx(4.6 + 0.9)
    assert u0["T_sync"] == pytest.approx(4.0 + 2.0 + 0.9)
    assert u0["slow_rank"] == 0 and u0["prediction_error_pct"] == pytest.approx(0.0, abs=1e-9)
    # later updates have a longer wall (1 s more per update): the inferred step absorbs it
    steady = res["updates"][1:]
    assert res["step_time_measured_mean"] == pytest.approx((6.5 + 7.5) / 2)
    assert res["speedup_predicted"] == pytest.approx(res["T_sync_mean"] / res["T_thundersync_mean"])
    assert res["T_thundersync_mean"] == pytest.approx(sum(u["T_thundersync"] for u in steady) / 2)
    pub = analyze_run(os.path.dirname(res["run_dir"]) + "/run", warmup=0, suffix="publish")
    assert pub["updates"][0]["P"] == pytest.approx(0.5) and pub["n_steady"] == 3


def test_cli_trace_and_analytic(tmp_path, capsys) -> None:
    run = write_run(tmp_path)
    assert main(["trace", run, "--json", "--warmup", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["updates"]) == 3 and out["n_steady"] == 1
    assert out["speedup_predicted"] == pytest.approx(out["updates"][2]["speedup"])
    assert out["step_time_measured_mean"] == pytest.approx(7.5)
    assert main(["trace", run]) == 0
    text = capsys.readouterr().out
    assert "steady state over 2 updates" in text and "thundersync" in text
    assert main(["trace", run, "--warmup", "3"]) == 2  # nothing left
    capsys.readouterr()
    assert main(["analytic", "--objective", "grpo", "--batch", "256", "--ratio", "1",
                 "--turns", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert close_to(out["speedup"], 1.84) and out["tail"] == pytest.approx(tail_grpo(1.0))


def test_ratio_means_rollout_over_learner_in_trace_and_analytic(tmp_path, capsys) -> None:
    """One name, one meaning: the `ratio` predict trace reports is R/L, the number
    `predict analytic --ratio` takes; `rho` is L/R in both."""
    res = analyze_run(write_run(tmp_path), warmup=0)
    for u in res["updates"]:  # busiest rank 0 serves 1 + 1 s per update, R = 4
        assert u["L"] == pytest.approx(2.0) and u["ratio"] == pytest.approx(4.0 / 2.0)
        assert u["rho"] == pytest.approx(1.0 / u["ratio"])
    assert res["ratio"] == pytest.approx(2.0)
    assert main(["trace", str(tmp_path / "run")]) == 0
    assert "ratio r = R/L 2.000, as `predict analytic --ratio` takes it" in capsys.readouterr().out
    # full waves (B >= Q): the analytic model's learner load is rho = 1/ratio, as in the trace
    out = analytic("grpo", 256, res["ratio"], 1)
    assert out["ratio"] == res["ratio"] and out["rho_w"] == pytest.approx(res["updates"][0]["rho"])
    # the perf/ sweeps use the same name for the same R/L
    perf = open(os.path.join(REPO, "perf", "bench", "cell.py")).read()
    assert "R = ratio * L[step.draw]" in perf


def test_one_step_off_segment_settles_at_the_slower_pipeline():
    # Two lanes, 20 unit-service jobs each arriving uniformly over R: L = 20·p. In steady
    # state the period is max(R, L + P) whether the rollout (r = 2) or the learner (r = 0.5,
    # 1) is the slower one; the first update (nothing to overlap with) takes R + tail + P.
    from tsync_mcore.observability.predict import (
        one_step_off_period,
        one_step_off_segment,
    )

    p, P, n = 0.05, 0.1, 20
    L = n * p
    for r in (0.5, 1.0, 2.0):
        R = r * L
        lanes = {k: [(R * (i + 1) / n, p) for i in range(n)] for k in (0, 1)}
        steps = one_step_off_segment([(R, lanes, P)] * 8)
        expect = one_step_off_period(R, L, P)
        assert steps[-1] == pytest.approx(expect, rel=1e-9), (r, steps)
        assert steps[0] == pytest.approx(max(R, lane_completion(lanes[0])) + P)
    # a reload longer than the learner's slack makes the rollout the bound
    R = L
    lanes = {0: [(R * (i + 1) / n, p) for i in range(n)]}
    assert one_step_off_segment([(R, lanes, P)] * 8, reload=0.4)[-1] == pytest.approx(R + 0.4)


def test_one_step_off_segment_shows_an_imbalanced_rank():
    # Rank 1 holds twice rank 0's work: the learner period follows the busier lane.
    from tsync_mcore.observability.predict import one_step_off_segment

    lanes = {0: [(0.1, 0.2)] * 5, 1: [(0.1, 0.4)] * 5}
    assert one_step_off_segment([(1.0, lanes, 0.1)] * 6)[-1] == pytest.approx(2.0 + 0.1)


def test_analyze_run_one_step_off_rows(tmp_path) -> None:
    # The same traces as one_step_off updates: the wall time runs publication to
    # publication (here 3.0), so the step is inferred from the tail after the last source's
    # arrival (3.6): t_stepped − last_end = (3.6 + 1.0) − 4.6 = 0; P = publish 0.5. The
    # prediction is the steady-state period max(R, L + P) = max(4, 2 + 0.5).
    run = write_run(tmp_path)
    path = os.path.join(run, "metrics.jsonl")
    rows = [json.loads(x) for x in open(path)]
    for r in rows:
        r.update(schedule="one_step_off", step_wall_time_s=3.0)
    open(path, "w").write("".join(json.dumps(r) + "\n" for r in rows))
    res = analyze_run(run, warmup=0)
    u = res["updates"][0]
    assert u["step_s"] == pytest.approx(0.0) and u["P"] == pytest.approx(0.5)
    assert u["T_async"] == pytest.approx(4.0)
    assert u["prediction_error_pct"] == pytest.approx(100.0 * (4.0 - 3.0) / 3.0)


def test_ppo_minibatches_follow_the_streamed_one_after_a_step_each() -> None:
    """m = 3: Eq. 14 covers mini-batch 1 and the later sources' old-log-prob forwards (served
    on arrival); mini-batches 2 and 3 run after it on both schedules, each after a step:
    T = max(R, c_1) + Σ_j (s + L_j) + P, T_sync = R + L_1 + Σ_j (s + L_j) + P."""
    e = [source(rank=0, ready=1.0, start=1.0, end=2.0),  # mini-batch 1
         source(rank=1, ready=2.0, start=2.0, end=3.5),
         deferred(rank=0, work="old_logprob", ready=2.5, start=2.5, end=2.75, traj_id="u"),
         source(rank=0, ready=2.5, start=6.0, end=7.0, minibatch=2, traj_id="u"),
         source(rank=1, ready=3.0, start=6.0, end=6.5, minibatch=2, traj_id="v"),
         source(rank=0, ready=4.0, start=7.5, end=8.0, minibatch=3, traj_id="w")]
    pred = predict_update(e, R=4.0, P=0.5, step_s=0.25)
    tail = (0.25 + 1.0) + (0.25 + 0.5)  # mini-batch 2's busiest rank, then 3's
    assert pred["minibatch_tail_s"] == pytest.approx(tail)
    assert pred["T_thundersync"] == pytest.approx(max(4.0, 3.5) + tail + 0.5)
    assert pred["T_sync"] == pytest.approx(4.0 + 1.5 + tail + 0.5)  # L_1: rank 1's 1.5
    assert pred["L"] == pytest.approx(1.5 + 1.0 + 0.5)
