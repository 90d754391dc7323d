"""Feeds a learner bad sources between good ones; reports the errors and whether θ moved.

Run as a script (one process). Prints `RESULT {json}`.
"""

import math
import sys
from dataclasses import replace

import torch

from tests.helpers.batchgen import make_batch  # noqa: E402
from tests.helpers.dist_util import emit  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, SourceError, TrajectorySource  # noqa: E402
from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner.policy import Policy  # noqa: E402
from tsync_mcore.learner.update import Learner  # noqa: E402


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(hf_dir: str) -> None:
    cfg = load_config(None, {"model.hf_dir": hf_dir, "learner.k_open": 2, "optim.lr": 1e-4})
    noisy = Policy(cfg)
    clean = Policy(cfg, par=noisy.par)
    vocab = noisy.vocab_size
    rows = sorted(make_batch(vocab, n_groups=3, m=3, seed=7), key=lambda r: r["ready_order"])
    srcs = [TrajectorySource.from_json(r) for r in rows]
    plan = BatchPlan.from_sources(srcs)
    theta0 = noisy.export_params()

    learner = Learner(cfg.learner, noisy)
    learner.begin(plan)
    good = srcs[0]
    bad = {
        "wrong_version": replace(good, traj_id="x1", policy_version=3),
        "group_not_registered": replace(good, traj_id="x2", group_id="nope"),
        "group_larger_than_registered": replace(good, traj_id="extra"),
        "nan_reward": replace(good, reward=math.nan),
        "inf_reward": replace(good, reward=math.inf),
        "token_out_of_vocab": replace(good, tokens=good.tokens[:-1] + (vocab,)),
        "negative_token": replace(good, tokens=(-1,) + good.tokens[1:]),
        "mask_length_mismatch": replace(good, scored_mask=good.scored_mask[:-1]),
        "first_token_scored": replace(good, scored_mask=(1,) + good.scored_mask[1:]),
    }
    errors: dict[str, str] = {}
    learner.submit(srcs[0])
    errors["duplicate"] = _err(learner.submit, srcs[0])
    for name, src in bad.items():
        errors[name] = _err(learner.submit, src)
    for s in srcs[1:-2]:
        learner.submit(s)
    errors["missing_members"] = _err(learner.close)
    missing_named = all(s.traj_id in errors["missing_members"] for s in srcs[-2:])
    theta_after_errors = noisy.export_params()
    for s in srcs[-2:]:
        learner.submit(s)
    r_noisy = learner.close(export_grad=True)

    ref = Learner(cfg.learner, clean)
    ref.begin(plan)
    for s in srcs:
        ref.submit(s)
    r_clean = ref.close(export_grad=True)

    theta1 = noisy.export_params()

    # Balanced routing: announcements of group rewards, checked against what arrived.
    fresh = Policy(cfg, par=noisy.par)  # at θ0, like the clean reference
    theta_bal0 = {k: v.clone() for k, v in fresh.export_params().items()}
    bal = Learner(cfg.learner, fresh)
    bal.begin(plan, routing="balanced")
    g0 = srcs[0].group_id
    members = plan.groups[g0]
    truth = {s.traj_id: float(s.reward) for s in srcs}
    announce = {t: truth[t] for t in members}
    bal.submit(srcs[0])
    bal_errors = {
        "unknown_group": _err(bal.group_rewards, "nope", announce),
        "wrong_members": _err(bal.group_rewards, g0, dict(list(announce.items())[:-1])),
        "nonfinite": _err(bal.group_rewards, g0, {**announce, members[-1]: math.nan}),
        "disagrees_with_arrival": _err(bal.group_rewards, g0, {**announce,
                                                               srcs[0].traj_id: truth[srcs[0].traj_id] + 1}),
    }
    bal.group_rewards(g0, announce)
    bal_errors["duplicate_announcement"] = _err(bal.group_rewards, g0, announce)
    late = next(s for s in srcs if s.group_id == g0 and s.traj_id != srcs[0].traj_id)
    bal_errors["source_disagrees_with_announcement"] = _err(bal.submit, replace(late, reward=late.reward + 1))
    for s in srcs[1:-1]:
        bal.submit(s)
    bal_errors["close_with_source_nowhere"] = _err(bal.close)
    bal_missing_named = srcs[-1].traj_id in bal_errors["close_with_source_nowhere"]
    theta_after_bal_errors = {k: v.clone() for k, v in fresh.export_params().items()}
    bal.submit(srcs[-1])
    r_bal = bal.close(export_grad=True)
    bal_grad_ok = all(torch.allclose(r_bal.grad[k], r_clean.grad[k], rtol=1e-5, atol=1e-7)
                      for k in r_clean.grad)

    out = {
        "bal_errors": bal_errors,
        "bal_missing_named": bal_missing_named,
        "theta_untouched_by_bal_errors": same(theta_bal0, theta_after_bal_errors),
        "bal_grad_matches_static": bal_grad_ok,
        "errors": errors,
        "missing_named": missing_named,
        "theta_untouched_by_errors": same(theta0, theta_after_errors),
        "grad_bitwise_equal_to_clean": same(r_noisy.grad, r_clean.grad),
        "params_bitwise_equal_to_clean": same(theta1, clean.export_params()),
        "theta_moved_after_close": not same(theta0, theta1),
        "empty_mask_sources": sum(1 for s in srcs if s.n_scored == 0),
    }
    emit(out)


def _err(fn, *args) -> str:
    try:
        fn(*args)
    except SourceError as e:
        return str(e)
    return "NO ERROR"


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(sys.argv[1])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
