"""Peer-compatible aggregation (learner.token_norm) and group std (learner.adv_std).

Every mode against an independent FP64 reference of its formula (tests/reference.py,
the peers' padded [B, T] form), on a batch with unequal group sizes and lengths, a uniform
group, a group of one and a trajectory with no scored token: sync and thundersync, static
and balanced routing, 2 DP ranks in one torchrun launch. A batch of only uniform groups
gives an exactly zero gradient in every mode. Config refusals name the key.
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import write_opd_batches
from tests.helpers.dist_util import REPO_ROOT, run_dist
from tests.helpers.reference import reference_agg_grad, reference_opd_grad, rel_l2
from tsync_mcore.config import ConfigError, load_config
from tsync_mcore.learner.replay import main as replay_main
from tsync_mcore.learner.replay import parse_args
from tsync_mcore.objectives import ADVANTAGES, group_stats
from tests.helpers.peer_objectives_shared import peer_rows, write_rows

H = 40.0  # token_norm_constant of seq_mean_token_sum_norm
# (token_norm, adv_std, objective): each under every schedule × routing in ROUTES
MODES = [("token_mean", "population", "grpo"),
         ("seq_mean_token_mean", "unbiased", "grpo"),
         ("seq_mean_token_sum_norm", "unbiased", "grpo"),
         ("group_scaled_token_mean", "population", "grpo"),
         ("trajectory", "unbiased", "grpo")]
ROUTES = [("sync", "static"), ("sync", "balanced"), ("thundersync", "static"),
          ("thundersync", "balanced")]
# the other affine estimators, once each, on the streaming path
EXTRA = [("seq_mean_token_mean", "population", "dr_grpo"), ("token_mean", "population", "rloo"),
         ("trajectory", "population", "grpo")]  # the default update
ZERO_MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm",
              "group_scaled_token_mean", "trajectory"]


def _overrides(norm, adv_std, objective, schedule):
    o = {"learner.token_norm": norm, "learner.adv_std": adv_std, "learner.objective": objective,
         "learner.schedule": schedule, "learner.k_open": 2}
    if norm == "seq_mean_token_sum_norm":
        o["learner.token_norm_constant"] = H
    return o


@pytest.fixture(scope="module")
def runs(tiny_qwen2, tmp_path_factory):
    d = tmp_path_factory.mktemp("peer")
    rows = peer_rows(256, [("uniform", 4), ("mixed", 3), ("mixed", 2), ("lone", 1), ("mixed", 5),
                       ("large", 3)], seed=7)
    zero_rows = peer_rows(256, [("uniform", 4), ("large", 1), ("const", 3), ("lone", 1)], seed=8)
    batch, zero = write_rows(d / "batch.jsonl", rows), write_rows(d / "zero.jsonl", zero_rows)
    cases = []
    for norm, adv_std, objective in MODES:
        for schedule, routing in ROUTES:
            cases.append(dict(name=f"{objective}-{norm}-{adv_std}-{schedule}-{routing}",
                              batch=batch, routing=routing,
                              overrides=_overrides(norm, adv_std, objective, schedule)))
    for norm, adv_std, objective in EXTRA:
        cases.append(dict(name=f"{objective}-{norm}-{adv_std}-thundersync-balanced",
                          batch=batch, routing="balanced",
                          overrides=_overrides(norm, adv_std, objective, "thundersync")))
    for j, norm in enumerate(ZERO_MODES):  # alternate std, schedule and routing
        adv_std = ("unbiased", "population")[j % 2]
        schedule, routing = ROUTES[(3, 0, 2, 1, 3)[j]]
        cases.append(dict(name=f"zero-{norm}-{adv_std}-{schedule}-{routing}", batch=zero,
                          routing=routing, overrides=_overrides(norm, adv_std, "grpo", schedule)))
    cases_path = d / "cases.json"
    cases_path.write_text(json.dumps(cases))
    out = d / "out"
    out.mkdir()
    res = run_dist([os.path.join(REPO_ROOT, "tests/helpers/workers/peer_objectives_worker.py"),
                    tiny_qwen2, str(cases_path), str(out)], nproc=2, timeout=600)
    return dict(rows=rows, hf_dir=tiny_qwen2, out=out, ranks=res, cases=cases)


def _grad(runs, name):
    return load_file(str(runs["out"] / f"{name}.safetensors"))


@pytest.fixture(scope="module")
def refs(runs):
    keys = {(n, a, o) for n, a, o in MODES + EXTRA}
    return {k: reference_agg_grad(runs["hf_dir"], runs["rows"], k[2], k[0], k[1],
                                  H if k[0] == "seq_mean_token_sum_norm" else 0.0)
            for k in sorted(keys)}


@pytest.mark.parametrize("norm,adv_std,objective", MODES + EXTRA)
def test_mode_equals_fp64_reference_of_its_formula(runs, refs, norm, adv_std, objective):
    ref = refs[norm, adv_std, objective]
    prefix = f"{objective}-{norm}-{adv_std}-"
    names = [c["name"] for c in runs["cases"] if c["name"].startswith(prefix)]
    assert names
    for name in names:
        got = _grad(runs, name)
        assert got.keys() == ref.keys()
        err = rel_l2(got, ref)
        print(f"{name} vs FP64 reference: rel L2 = {err:.2e}")
        assert err <= 1e-5, (name, err)


def test_modes_differ_so_the_comparison_can_fail(refs):
    # Unequal group sizes and lengths: every mode (and each std) is a different update.
    keys = sorted(refs)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert rel_l2(refs[a], refs[b]) > 1e-2, (a, b)


def test_uniform_groups_give_exact_zeros(runs):
    names = [c["name"] for c in runs["cases"] if c["name"].startswith("zero-")]
    assert len(names) == len(ZERO_MODES)
    for name in names:
        got = _grad(runs, name)
        nonzero = sum(int(torch.count_nonzero(t)) for t in got.values())
        assert nonzero == 0, (name, nonzero)


def test_balanced_routing_served_each_trajectory_once(runs):
    by_rank = [r["cases"] for r in runs["ranks"]]
    for c in runs["cases"]:
        if c["batch"].endswith("batch.jsonl") and c["routing"] == "balanced":
            served = [r[c["name"]]["served_here"] for r in by_rank]
            assert sum(served) == len(runs["rows"]) and min(served) > 0, (c["name"], served)
            assert all(r[c["name"]]["ok"] for r in by_rank)


def test_unbiased_std_and_group_of_one():
    r = [0.1, 0.9, 0.4, 0.4, 1.0]
    t = torch.tensor(r, dtype=torch.float64)
    assert math.isclose(group_stats(r, r[0], ddof=1).std, float(t.std(unbiased=True)),
                        rel_tol=1e-14)
    assert math.isclose(group_stats(r, r[0]).std, float(t.std(unbiased=False)), rel_tol=1e-14)
    assert group_stats([0.7], 0.7, ddof=1).std == 0.0  # 0/0 defined as 0
    for ddof in (0, 1):
        assert ADVANTAGES["grpo"].advantages([0.7], 1e-6, ddof) == [0.0]
        assert ADVANTAGES["grpo"].advantages([0.3] * 4, 1e-6, ddof) == [0.0] * 4
        assert ADVANTAGES["grpo"].closure([0.3] * 4, 0.3, 1e-6, ddof, group_mean=False)[1] == 0.0
    a = ADVANTAGES["grpo"].advantages(r, 1e-6, 1)
    want = (t - t.mean()) / (t.std(unbiased=True) + 1e-6)
    assert max(abs(x - float(y)) for x, y in zip(a, want)) < 1e-12
    # group_mean=False is the same coefficient times m
    assert math.isclose(ADVANTAGES["grpo"].source_coef(r, 1, 1e-6, 1, group_mean=False),
                        5 * ADVANTAGES["grpo"].source_coef(r, 1, 1e-6, 1), rel_tol=1e-14)


def test_config_resolution_and_refusals(capsys):
    assert load_config(None, {}).learner.token_norm == "trajectory"
    assert load_config(None, {}).learner.adv_std == "population"
    assert load_config(None, {"learner.objective": "opd"}).learner.token_norm == "token_mean"
    capsys.readouterr()
    cfg = load_config(None, {"learner.token_norm": "global"})
    assert cfg.learner.token_norm == "group_scaled_token_mean"
    err = capsys.readouterr().err
    assert "'global' is deprecated; resolved to 'group_scaled_token_mean'" in err
    cfg = load_config(None, {"learner.objective": "opd", "learner.token_norm": "global"})
    assert cfg.learner.token_norm == "token_mean"  # what 'global' computed for OPD
    assert "resolved to 'token_mean' for opd" in capsys.readouterr().err
    ok = load_config(None, {"learner.objective": "opd", "learner.token_norm_constant": 64,
                            "learner.token_norm": "seq_mean_token_sum_norm"})
    assert ok.learner.token_norm_constant == 64.0
    for over, key, why in [
        ({"learner.objective": "opd", "learner.token_norm": "seq_mean_token_mean"},
         "learner.token_norm", "OPD streams turns"),
        ({"learner.objective": "opd", "learner.token_norm": "trajectory"},
         "learner.token_norm", "OPD streams turns"),
        ({"learner.objective": "opd", "learner.token_norm": "group_scaled_token_mean"},
         "learner.token_norm", "1/m_G"),
        ({"learner.token_norm": "seq_mean_token_sum_norm"}, "learner.token_norm_constant",
         "must be > 0"),
        ({"learner.token_norm_constant": 8}, "learner.token_norm_constant", "leave it 0"),
        ({"learner.objective": "dr_grpo", "learner.adv_std": "unbiased"}, "learner.adv_std",
         "does not divide"),
        ({"learner.objective": "opd", "learner.adv_std": "unbiased"}, "learner.adv_std",
         "does not divide"),
        ({"learner.adv_std": "bessel"}, "learner.adv_std", "must be one of"),
        ({"learner.token_norm": "seq-mean-token-mean"}, "learner.token_norm", "must be one of"),
    ]:
        with pytest.raises(ConfigError, match=f"'{key}'.*{why}"):
            load_config(None, over)


@pytest.fixture(scope="module")
def cli_replays(tiny_qwen2, tmp_path_factory):
    """The replay command's flags end to end, both of the tests below in one process (each
    job the command's main() on its own argv: tests/helpers/replay.py, replay_many)."""
    from tests.helpers.replay import replay_many
    d = tmp_path_factory.mktemp("peer_cli")
    rows = peer_rows(256, [("mixed", 3), ("mixed", 2), ("uniform", 2)], seed=9)
    opd_rows = write_opd_batches(str(d / "opd.jsonl"), 256, seed=3)
    jobs = {"flags": ["--model", tiny_qwen2, "--batch", write_rows(d / "b.jsonl", rows),
                      "--token-norm", "seq_mean_token_mean", "--adv-std", "unbiased",
                      "--k-open", "1"],
            "opd": ["--model", tiny_qwen2, "--batch", str(d / "opd.jsonl"), "--objective",
                    "opd", "--token-norm", "seq_mean_token_sum_norm", "--token-norm-constant",
                    str(H)]}
    return dict(replay_many(jobs, str(d), nproc=1), rows=rows, opd_rows=opd_rows, d=d)


def test_replay_flags(tiny_qwen2, cli_replays):
    args = parse_args(["--model", "m", "--batch", "b", "--out", "o", "--token-norm",
                       "seq_mean_token_sum_norm", "--token-norm-constant", "32",
                       "--adv-std", "unbiased"])
    assert (args.token_norm, args.token_norm_constant, args.adv_std) == \
        ("seq_mean_token_sum_norm", 32.0, "unbiased")
    # End to end in one process: the flags reach the learner.
    rows = cli_replays["rows"]
    got = load_file(os.path.join(cli_replays["flags"]["dir"], "grad.safetensors"))
    err = rel_l2(got, reference_agg_grad(tiny_qwen2, rows, "grpo", "seq_mean_token_mean",
                                         "unbiased"))
    print(f"replay --token-norm seq_mean_token_mean --adv-std unbiased vs FP64: {err:.2e}")
    assert err <= 1e-5
    with pytest.raises(ConfigError, match="learner.token_norm_constant"):
        replay_main(["--model", tiny_qwen2, "--batch", str(cli_replays["d"] / "b.jsonl"),
                     "--out", str(cli_replays["d"] / "o2"), "--token-norm",
                     "seq_mean_token_sum_norm"])


def test_opd_seq_mean_token_sum_norm(tiny_qwen2, cli_replays):
    # OPD streams turns: 1/(B·H) needs no trajectory length, so it runs there; the reference
    # is Eq. 8–9's 1/N_k gradient rescaled to N_k/(B·H).
    rows = cli_replays["opd_rows"]
    got = load_file(os.path.join(cli_replays["opd"]["dir"], "grad.safetensors"))
    n_scored = sum(sum(r["scored_mask"]) for r in rows)
    ref = {k: v * n_scored / (len(rows) * H)
           for k, v in reference_opd_grad(tiny_qwen2, rows).items()}
    err = rel_l2(got, ref)
    print(f"opd seq_mean_token_sum_norm vs FP64 reference: {err:.2e}")
    assert err <= 1e-5
