"""Off-policy correction and the lag/mismatch figures (docs/design/async.md#off-policy-correction-and-the-lag-and-mismatch-figures).

The one_step_off update (sources sampled by θ_{k−1}, behaviour log-probs from the file, TIS
with a cap that truncates some tokens) against an independent FP64 reference of the same
objective on the Hugging Face model, GRPO and OPD, through the replay command on 2 DP
ranks; in process (1 rank): streaming exactness with per-token weights, the schedules' lag
bounds, IS weights of 1 when the behaviour is the learner's own policy, and the trace.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import action_first, make_batch, make_opd_batch
from tests.helpers.off_policy import CAP, _hf, _token_logp, _with_behaviour
from tests.helpers.paths import ROOT
from tests.helpers.reference import advantages, rel_l2
from tests.helpers.replay import replay
from tsync_mcore.channel.sources import SourceError
from tsync_mcore.observability import trace
from tsync_mcore.observability.trace import SourceRecord, UpdateRecord

VOCAB = 256








def _write(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


# --- the independent reference: the off-policy objective written out, FP64 -----------------

def _rho(lp: torch.Tensor, behaviour: list, mask: torch.Tensor) -> torch.Tensor:
    b = torch.tensor([x if x is not None else 0.0 for x in behaviour[1:]], dtype=torch.float64)
    return torch.where(mask, torch.exp(lp.detach() - b).clamp(max=CAP), torch.zeros_like(b))


def reference_grpo_tis(model, rows: list[dict]) -> dict[str, torch.Tensor]:
    """J = (1/n_groups) Σ_G (1/m) Σ_i A_i (1/L_i) Σ_t ρ_t log π_θ(a_t), ρ_t =
    min(π_θ/π_b, C) detached (token_norm trajectory, GRPO advantages)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    J = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        adv = advantages(torch.tensor([r["reward"] for r in members], dtype=torch.float64),
                         "grpo")
        for a, r in zip(adv, members):
            mask = torch.tensor(r["scored_mask"][1:], dtype=torch.bool)
            if not mask.any():
                continue
            lp = _token_logp(model, r["tokens"])
            rho = _rho(lp, r["behaviour_logprobs"], mask)
            J = J + a / (len(groups) * len(members) * mask.sum()) * (rho * lp).sum()
    return _grads(model, J)


def reference_opd_tis(model, rows: list[dict]) -> dict[str, torch.Tensor]:
    """J = (1/N_k) Σ_t ρ_t · sg[log π_T − log π_θ] · log π_θ (Eq. 8–9 with TIS)."""
    n = sum(sum(r["scored_mask"]) for r in rows)
    J = torch.zeros((), dtype=torch.float64)
    for r in rows:
        mask = torch.tensor(r["scored_mask"][1:], dtype=torch.bool)
        if not mask.any():
            continue
        lp = _token_logp(model, r["tokens"])
        teacher = torch.tensor([t if t is not None else 0.0 for t in r["teacher_logprobs"][1:]],
                               dtype=torch.float64)
        rho = _rho(lp, r["behaviour_logprobs"], mask)
        J = J + (rho * (teacher - lp).detach() * lp)[mask].sum() / n
    return _grads(model, J)


def _grads(model, J) -> dict[str, torch.Tensor]:
    params = list(model.named_parameters())
    grads = torch.autograd.grad(J, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}


def _truncated_share(model, rows) -> float:
    n = cut = 0
    with torch.no_grad():
        for r in rows:
            lp = _token_logp(model, r["tokens"])
            for t, b in enumerate(r["behaviour_logprobs"][1:]):
                if r["scored_mask"][t + 1]:
                    n += 1
                    cut += float(torch.exp(lp[t] - b)) > CAP
    return cut / n


# --- one_step_off through the replay command: update 1 trains θ_0's samples ----------------

@pytest.fixture(scope="module")
def off_policy_runs(tiny_qwen2, tmp_path_factory):
    d = tmp_path_factory.mktemp("off_policy")
    model = _hf(tiny_qwen2)
    grpo = _with_behaviour(model, make_batch(VOCAB, n_groups=3, m=3, version=0, seed=7),
                           seed=1, update=1)
    opd = _with_behaviour(model, action_first(make_opd_batch(VOCAB, n_traj=4, turns=3,
                                                             version=0, seed=4)),
                          seed=2, update=1)
    flags = ["--schedule", "one_step_off", "--start-version", "1", "--is-correction", "tis",
             "--is-cap", str(CAP), "--lr", "1e-5", "--save-grads", "all"]
    out = {"model": model, "grpo_rows": grpo, "opd_rows": opd}
    for name, rows, extra in [("grpo", grpo, []), ("opd", opd, ["--objective", "opd"])]:
        o = str(d / name)
        out[name] = dict(summary=replay(tiny_qwen2, _write(str(d / f"{name}.jsonl"), rows), o,
                                        2, *flags, *extra), dir=o)
    return out


@pytest.mark.parametrize("name", ["grpo", "opd"])
def test_one_step_off_matches_fp64_off_policy_reference(off_policy_runs, name):
    runs = off_policy_runs
    rows = runs[f"{name}_rows"]
    ref = (reference_grpo_tis if name == "grpo" else reference_opd_tis)(runs["model"], rows)
    got = load_file(os.path.join(runs[name]["dir"], "grad_1.safetensors"))
    assert got.keys() == ref.keys()
    err = rel_l2(got, ref)
    s = runs[name]["summary"]
    share = _truncated_share(runs["model"], rows)
    print(f"{name} one_step_off + TIS (cap {CAP}, {share:.0%} truncated) vs FP64 reference: "
          f"rel L2 = {err:.2e}")
    assert err <= 1e-5
    # Every scored token is θ_0's, trained at update 1, and carried a behaviour log-prob.
    n = sum(sum(r["scored_mask"]) for r in rows)
    assert s["first_update"] == 1 and s["policy_lag_mean"] == [1.0]
    assert s["policy_lag_max"] == [1] and s["lagged_token_share"] == [1.0]
    assert s["mismatch_tokens"] == [n] and s["scored_tokens"] == [n]
    assert 0 < share < 1 and abs(s["is_truncated_share"][0] - share) < 1e-12
    assert s["is_weight_max"][0] > CAP and s["is_weight_min"][0] < 1


def test_trace_carries_lag_per_source_and_update(off_policy_runs):
    run = off_policy_runs["grpo"]
    recs = [x for r in range(2)
            for x in trace.read(os.path.join(run["dir"], f"trace_rank{r}.jsonl"))]
    srcs = [r for r in recs if isinstance(r, SourceRecord)]
    assert srcs and all(r.update == 1 and r.policy_version == 0 and r.policy_lag == 1
                        and r.lagged_tokens == r.scored_tokens for r in srcs)
    ups = [r for r in recs if isinstance(r, UpdateRecord)]
    assert len(ups) == 2 and all(u.policy_lag_max == 1 and u.is_truncated_share > 0 for u in ups)
    # A trace written before the lag and mismatch fields existed still reads (defaults).
    old = {k: v for k, v in json.loads(trace.to_json(ups[0])).items()
           if k not in ("policy_lag_mean", "policy_lag_max", "lagged_token_share",
                        "mismatch_tokens", "logprob_diff_mean", "is_weight_mean",
                        "is_weight_max", "is_weight_min", "is_truncated_share")}
    u = trace.parse(old)
    assert u.policy_lag_max == 0 and u.logprob_diff_mean is None
    s = json.loads(trace.to_json(srcs[0]))
    del s["policy_lag"], s["lagged_tokens"]
    assert trace.parse(s).policy_lag == 0


def test_replay_refuses_bad_off_policy_input(off_policy_runs, tiny_qwen2, tmp_path):
    """Wrong lengths, positive log-probs, a lag beyond the schedule's bound: FILE:LINE and
    what is wrong, before any model exists; the command says it in one line (exit 2)."""
    from tsync_mcore.learner.replay import batches_from_lines
    good = off_policy_runs["grpo_rows"]
    b = good[1]["behaviour_logprobs"]
    pos = next(t for t, m in enumerate(good[1]["scored_mask"]) if m)
    cases = [  # (line 2, max_lag, message)
        (dict(good[1], behaviour_logprobs=b[:-1]), 1, "behaviour_logprobs has"),
        (dict(good[1], behaviour_logprobs=b[:pos] + [0.5] + b[pos + 1:]), 1,
         f"behaviour log-prob 0.5 at token {pos} is not a log-probability"),
        (dict(good[1], token_versions=[0] * (len(b) - 1)), 1, "token_versions has"),
        (good[1], 0, "policy_version 0 is 1 updates behind update 1"),
        (dict(good[1], update=3), 2, "policy_version 0 is 3 updates behind update 3"),
        (dict(good[1], update=1, policy_version=2), 2, "policy_version 2 is after update 1"),
    ]
    for row, lag, want in cases:
        lines = [json.dumps(dict(good[0], policy_version=1)).encode(), json.dumps(row).encode()]
        with pytest.raises(SourceError) as e:
            batches_from_lines("f.jsonl", lines, start=1, max_lag=lag)
        assert str(e.value).startswith("f.jsonl:2: ") and want in str(e.value), str(e.value)
    path = _write(str(tmp_path / "lag.jsonl"), [good[0], dict(good[1], update=3)])
    p = subprocess.run([sys.executable, "-m", "tsync_mcore.learner.replay", "--model", tiny_qwen2,
                        "--batch", path, "--out", str(tmp_path / "out"), "--start-version", "1",
                        "--schedule", "one_step_off"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1, p.stderr[-2000:]
    assert err.startswith(f"error: {path}:2: policy_version 0 is 3 updates behind update 3")


# --- in process, one rank: streaming exactness, lag bounds, the mismatch -------------------

def _learner(hf_dir, par, version=0, **learner):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-5,
                             **{f"learner.{k}": v for k, v in learner.items()}})
    return Learner(cfg.learner, Policy(cfg, par=par), policy_version=version)


def _update(learner, sources, **begin):
    from tsync_mcore.channel.sources import BatchPlan
    learner.begin(BatchPlan.from_sources(sources), **begin)
    for s in sources:
        try:
            learner.submit(s)
        except SourceError as e:
            learner.reject(s, str(e))
    return learner.close(export_grad=True)


def _sources(rows):
    from tsync_mcore.channel.sources import TrajectorySource
    order = sorted(rows, key=lambda r: r["ready_order"])
    return [TrajectorySource.from_json({k: v for k, v in r.items() if k != "update"})
            for r in order]


def test_streaming_stays_exact_with_tis(tiny_qwen2, parallel1, off_policy_runs):
    """thundersync (shared prompts, k_open 1) against sync (whole sequences) with TIS on:
    per-token weights keep every streaming identity linear."""
    rows = _with_behaviour(off_policy_runs["model"],
                           make_batch(VOCAB, n_groups=3, m=3, version=0, seed=11), seed=3)
    srcs = _sources(rows)
    tis = dict(is_correction="tis", is_cap=CAP)
    sync = _update(_learner(tiny_qwen2, parallel1, schedule="sync", shared_prefix=False, **tis),
                   srcs)
    ts = _update(_learner(tiny_qwen2, parallel1, schedule="thundersync", k_open=1, **tis), srcs)
    off = _update(_learner(tiny_qwen2, parallel1, schedule="thundersync"), srcs)
    err = rel_l2(ts.grad, sync.grad)
    print(f"thundersync vs sync, TIS on: rel L2 = {err:.2e}")
    assert err <= 1e-6
    assert rel_l2(off.grad, sync.grad) > 1e-2  # the weights changed the update
    for r in (sync, ts, off):  # on-policy: no lag; the mismatch is reported either way
        u = r.summary
        assert u.policy_lag_max == 0 and u.lagged_token_share == 0.0
        assert u.mismatch_tokens == u.scored_tokens and u.is_truncated_share > 0


def test_sync_schedules_refuse_lagged_sources_and_count_them(tiny_qwen2, parallel1,
                                                             off_policy_runs):
    rows = off_policy_runs["grpo_rows"]  # policy_version 0
    g0 = rows[0]["group_id"]
    for schedule in ("sync", "group_ready", "thundersync"):
        lagged = [r for r in rows if r["group_id"] == g0]
        fresh = [dict(r, policy_version=1, traj_id=r["traj_id"] + "n", group_id="n")
                 for r in rows if r["group_id"] != g0][:3]
        res = _update(_learner(tiny_qwen2, parallel1, version=1, schedule=schedule),
                      _sources(lagged + fresh))
        u = res.summary
        assert list(u.dropped_groups) == [g0] and len(u.rejected_sources) >= 1, schedule
        assert "not the current version 1" in u.rejected_sources[0][1]
        assert u.n_groups == 1 and u.policy_lag_max == 0 and u.lagged_token_share == 0.0
    # fully_async at update 3, max_staleness 2: lag 2 trains, lag 3 is refused.
    lag2 = [dict(r, policy_version=1) for r in rows if r["group_id"] == g0]
    lag3 = [r for r in rows if r["group_id"] != g0]
    res = _update(_learner(tiny_qwen2, parallel1, version=3, schedule="fully_async",
                           max_staleness=2), _sources(lag2 + lag3))
    u = res.summary
    assert set(u.dropped_groups) == {r["group_id"] for r in lag3}
    assert "3 updates behind" in u.rejected_sources[0][1]
    assert u.policy_lag_max == 2 and u.policy_lag_mean == 2.0 and u.lagged_token_share == 1.0


def test_token_versions_give_the_lag_per_token(tiny_qwen2, parallel1, off_policy_runs):
    """A trajectory straddling a weight swap (fully_async): its tokens after the swap are
    the newer version's, so only the earlier ones count as lagged."""
    rows = [r for r in off_policy_runs["grpo_rows"]
            if r["group_id"] == off_policy_runs["grpo_rows"][0]["group_id"]]
    tv = []  # version 1 up to each row's second scored token, then 2
    for r in rows:
        cut = [t for t, m in enumerate(r["scored_mask"]) if m][1] + 1
        tv.append([1] * cut + [2] * (len(r["tokens"]) - cut))
    srcs = _sources([dict(r, policy_version=1, token_versions=v) for r, v in zip(rows, tv)])
    learner = _learner(tiny_qwen2, parallel1, version=2, schedule="fully_async", max_staleness=1)
    res = _update(learner, srcs)
    u = res.summary
    old = [sum(m for m, v in zip(r["scored_mask"], t) if v == 1) for r, t in zip(rows, tv)]
    n = sum(sum(r["scored_mask"]) for r in rows)
    recs = {r.traj_id: r for r in _update_records(res)}
    assert [recs[r["traj_id"]].lagged_tokens for r in rows] == old
    assert all(recs[r["traj_id"]].policy_lag == 1 for r in rows)
    assert u.policy_lag_max == 1 and u.lagged_token_share == pytest.approx(sum(old) / n)
    assert u.policy_lag_mean == pytest.approx(sum(old) / n)
    # A token of a version after the current one is refused.
    from tsync_mcore.channel.sources import BatchPlan
    n_tok = len(rows[0]["tokens"])
    future = _sources([dict(rows[0], policy_version=2, token_versions=[2] * (n_tok - 1) + [4])])
    learner.begin(BatchPlan.from_sources(future))
    with pytest.raises(SourceError, match="after the current version 3"):
        learner.submit(future[0])
    learner.abort()


def _update_records(result):
    return [r for r in result.trace if isinstance(r, SourceRecord)]


def test_own_behaviour_gives_weights_of_one_and_reports_the_mismatch(tiny_qwen2, parallel1):
    """Behaviour log-probs from the HF model in FP32 (what a rollout on the same weights
    reports): ρ is 1 up to the HF-vs-Megatron numerical difference, which is the figure."""
    rows = make_batch(VOCAB, n_groups=2, m=3, version=0, seed=13)
    model32 = _hf(tiny_qwen2, torch.float32)
    model64 = _hf(tiny_qwen2)
    own = _with_behaviour(model32, rows, seed=0, exact=True)
    on = _update(_learner(tiny_qwen2, parallel1, schedule="thundersync", is_correction="tis"),
                 _sources(own))
    plain = _update(_learner(tiny_qwen2, parallel1, schedule="thundersync"), _sources(rows))
    u = on.summary
    # Expected figure: |log π_θ − log π_b|, log π_θ the learner's (≈ FP64 HF to ~1e-6).
    diffs = []
    with torch.no_grad():
        for r in own:
            lp = _token_logp(model64, r["tokens"])
            diffs += [abs(float(lp[t - 1]) - b) for t, b in enumerate(r["behaviour_logprobs"])
                      if r["scored_mask"][t]]
    print(f"own behaviour: logprob_diff_mean {u.logprob_diff_mean:.2e} (HF FP32 vs FP64 "
          f"{sum(diffs) / len(diffs):.2e}), IS weight in [{u.is_weight_min:.8f}, "
          f"{u.is_weight_max:.8f}]")
    assert u.mismatch_tokens == u.scored_tokens == len(diffs)
    assert 0 < u.logprob_diff_mean < 1e-5 and u.is_truncated_share == 0.0
    bound = math.exp(max(diffs) + 1e-5) - 1
    assert 1 - bound <= u.is_weight_min <= u.is_weight_mean <= u.is_weight_max <= 1 + bound
    assert abs(u.is_weight_mean - 1) <= u.logprob_diff_mean * 1.01 + 1e-7
    assert rel_l2(on.grad, plain.grad) <= 1e-5  # the correction is (numerically) inert
    # No behaviour log-probs: no mismatch figures.
    assert plain.summary.mismatch_tokens == 0 and plain.summary.is_weight_mean is None


# --- mismatch guards beyond TIS: masked IS, sequence-level TIS/MIS, rejection --------------

def _guard_weights(lp: list[float], b: list[float], mode: str, low: float,
                   cap: float) -> list[float]:
    """ρ of one sequence's scored tokens, written out with floats (docs/design/objectives.md)."""
    r = [math.exp(x - y) for x, y in zip(lp, b)]
    if mode == "mis":
        return [x if low <= x <= cap else 0.0 for x in r]
    g = math.exp(sum(x - y for x, y in zip(lp, b)) / len(lp))
    keep = low <= g <= cap
    return {"seq_tis": [min(g, cap)] * len(r), "seq_mis": [g if keep else 0.0] * len(r),
            "seq_reject": [1.0 if keep else 0.0] * len(r)}[mode]


def reference_grpo_guard(model, rows, mode, low, cap) -> tuple[dict, int, int]:
    """J = (1/n_groups) Σ_G (1/m) Σ_i A_i (1/L_i) Σ_t ρ_t log π_θ(a_t) with the guard's ρ
    (a dropped token keeps its place in L_i); also (tokens dropped, tokens truncated)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    J, dropped, cut = torch.zeros((), dtype=torch.float64), 0, 0
    for members in groups.values():
        adv = advantages(torch.tensor([r["reward"] for r in members], dtype=torch.float64),
                         "grpo")
        for a, r in zip(adv, members):
            at = [t for t in range(1, len(r["tokens"])) if r["scored_mask"][t]]
            if not at:
                continue
            lp = _token_logp(model, r["tokens"])
            scored = torch.stack([lp[t - 1] for t in at])
            b = [r["behaviour_logprobs"][t] for t in at]
            rho = _guard_weights(scored.tolist(), b, mode, low, cap)
            dropped += sum(x == 0.0 for x in rho) if mode != "seq_tis" else 0
            if mode == "seq_tis":
                cut += len(at) * (math.exp(sum(x - y for x, y in zip(scored.tolist(), b))
                                           / len(at)) > cap)
            J = J + a / (len(groups) * len(members) * len(at)) * \
                (torch.tensor(rho, dtype=torch.float64) * scored).sum()
    return _grads(model, J), dropped, cut


GUARDS = [("mis", 0.6, CAP), ("seq_tis", 0.0, 1.15), ("seq_mis", 0.9, 1.15),
          ("seq_reject", 0.9, 1.15)]


def test_mismatch_guards_stream_exactly_and_match_the_fp64_reference(
        tiny_qwen2, parallel1, off_policy_runs):
    """Each guard's weights are fixed at the source's arrival: thundersync (shared prompts,
    k_open 1) equals sync, and both the FP64 reference written out per sequence; the
    dropped / truncated shares are the reference's counts. (One learner per schedule for
    every guard: at lr 1e-30 the step leaves θ as it was.)"""
    from tsync_mcore.objectives.off_policy import OffPolicy
    rows = _with_behaviour(off_policy_runs["model"],
                           make_batch(VOCAB, n_groups=4, m=3, version=0, seed=17), seed=5)
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner

    def learner(**kw):
        cfg = load_config(None, {"model.hf_dir": tiny_qwen2, "optim.lr": 1e-30,
                                 **{f"learner.{k}": v for k, v in kw.items()}})
        return Learner(cfg.learner, Policy(cfg, par=parallel1))
    learners = {"sync": learner(schedule="sync", shared_prefix=False),
                "ts": learner(schedule="thundersync", k_open=1)}
    for k, (mode, low, cap) in enumerate(GUARDS):
        srcs = _sources([dict(r, policy_version=k) for r in rows])  # update k's samples
        res = {}
        for name, ln in learners.items():
            ln.off_policy = OffPolicy(mode, cap, ln.policy.device, low=low)
            res[name] = _update(ln, srcs)
        ref, dropped, cut = reference_grpo_guard(off_policy_runs["model"], rows, mode, low, cap)
        err_sync, err_ref = rel_l2(res["ts"].grad, res["sync"].grad), rel_l2(res["ts"].grad, ref)
        u = res["ts"].summary
        print(f"{mode} [{low}, {cap}]: thundersync vs sync {err_sync:.2e}, vs FP64 "
              f"{err_ref:.2e}, dropped {u.is_dropped_share:.0%}, truncated "
              f"{u.is_truncated_share:.0%}")
        assert err_sync <= 1e-6 and err_ref <= 1e-5, mode
        n = u.mismatch_tokens
        assert n == u.scored_tokens and u.is_dropped_share == pytest.approx(dropped / n)
        if mode == "seq_tis":
            assert u.is_truncated_share == pytest.approx(cut / n) and 0 < cut < n
        else:  # the guard acted on some tokens and not on all
            assert 0 < dropped < n, mode


def test_sequence_guards_are_refused_for_opd():
    from tsync_mcore.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="'seq_mis' weights a whole sequence"):
        load_config(None, {"learner.objective": "opd", "learner.is_correction": "seq_mis"})
    load_config(None, {"learner.objective": "opd", "learner.is_correction": "mis"})
