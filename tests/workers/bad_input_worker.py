"""Feeds a learner bad sources between good ones; reports the errors and whether θ moved.

Run as a script (one process). Prints `RESULT {json}`.
"""

import json
import math
import sys
from dataclasses import replace

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0] + "/tests")
from batchgen import make_batch  # noqa: E402

from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner import Learner  # noqa: E402
from tsync_mcore.policy import Policy  # noqa: E402
from tsync_mcore.sources import BatchPlan, SourceError, TrajectorySource  # noqa: E402


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
    out = {
        "errors": errors,
        "missing_named": missing_named,
        "theta_untouched_by_errors": same(theta0, theta_after_errors),
        "grad_bitwise_equal_to_clean": same(r_noisy.grad, r_clean.grad),
        "params_bitwise_equal_to_clean": same(theta1, clean.export_params()),
        "theta_moved_after_close": not same(theta0, theta1),
        "empty_mask_sources": sum(1 for s in srcs if s.n_scored == 0),
    }
    print("RESULT " + json.dumps(out), flush=True)


def _err(fn, *args) -> str:
    try:
        fn(*args)
    except SourceError as e:
        return str(e)
    return "NO ERROR"


if __name__ == "__main__":
    main(sys.argv[1])
