"""Feeds an OPD learner bad turns between good ones; reports errors and whether θ moved."""

import math
import sys
from dataclasses import replace

import torch  # noqa: E402

from tests.helpers.batchgen import make_opd_batch  # noqa: E402
from tests.helpers.dist_util import emit  # noqa: E402
from tests.helpers.reference import rel_l2  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, SourceError, opd_turns_from_json  # noqa: E402
from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner.policy import Policy  # noqa: E402
from tsync_mcore.learner.update import Learner  # noqa: E402


def main(hf_dir: str) -> None:
    cfg = load_config(None, {"model.hf_dir": hf_dir, "learner.objective": "opd", "optim.lr": 1e-4})
    noisy = Policy(cfg)
    clean = Policy(cfg, par=noisy.par)
    rows = make_opd_batch(noisy.vocab_size, n_traj=3, turns=3, seed=4)
    turns = sorted([t for r in rows for t in opd_turns_from_json(r)], key=lambda t: t.ready_order)
    plan = BatchPlan.from_sources(turns)
    theta0 = noisy.export_params()

    learner = Learner(cfg.learner, noisy)
    learner.begin(plan)
    scored = next(t for t in turns if t.n_scored > 0 and t.turn == 0)
    i = scored.scored_mask.index(1)
    tl = list(scored.teacher_logprobs)
    bad = {
        "teacher_missing": replace(scored, teacher_logprobs=tuple(tl[:i] + [None] + tl[i + 1:])),
        "teacher_nan": replace(scored, teacher_logprobs=tuple(tl[:i] + [math.nan] + tl[i + 1:])),
        "teacher_misaligned": replace(scored, teacher_logprobs=tuple(tl[:-1])),
        "wrong_version": replace(scored, policy_version=5),
        "gap_in_spans": replace(scored, turn=1, start=scored.end + 1, ready_order=-1),
    }
    learner.submit(scored)
    errors = {name: _err(learner.submit, t) for name, t in bad.items()}
    # Hold back turn 0 of one trajectory while its turn 1 arrives: it must wait, not fail.
    late = next(t for t in turns if t.turn == 0 and t.traj_id != scored.traj_id)
    early = next(t for t in turns if t.traj_id == late.traj_id and t.turn == 1)
    order = [t for t in turns if t not in (late, early, scored)]
    first, rest = order[:4], order[4:]
    for t in first:
        learner.submit(t)
    learner.submit(early)
    held = early.key in learner.batch.arrived and learner.kind.ctx.get(early.traj_id) is None
    learner.submit(late)
    served = len(learner.kind.ctx.get(late.traj_id).turns) == 2 if learner.kind.ctx.get(late.traj_id) else False
    errors["duplicate"] = _err(learner.submit, late)
    for t in rest[:-1]:
        learner.submit(t)
    errors["missing_turns"] = _err(learner.close)
    theta_after_errors = noisy.export_params()
    learner.submit(rest[-1])
    r_noisy = learner.close(export_grad=True)

    ref = Learner(cfg.learner, clean)
    ref.begin(plan)
    for t in turns:
        ref.submit(t)
    r_clean = ref.close(export_grad=True)
    out = {
        "errors": errors,
        "theta_untouched_by_errors": all(torch.equal(theta0[k], theta_after_errors[k]) for k in theta0),
        "out_of_order_turn_held_then_served": bool(held and served),
        "grad_equal_to_clean": rel_l2(r_noisy.grad, r_clean.grad),
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
