"""Learner FLOPs with and without the shared-prefix backward (groups of 8, prompt = half)."""

import random
import sys

from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.dist_util import emit  # noqa: E402
from tests.helpers.reference import rel_l2  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, TrajectorySource  # noqa: E402
from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner.policy import Policy  # noqa: E402
from tsync_mcore.learner.update import Learner  # noqa: E402
from tsync_mcore.observability.ledger.account import update_flops  # noqa: E402


def batch(vocab: int, n_groups: int = 2, m: int = 8, prompt: int = 32, cont: int = 32):
    rng = random.Random(0)
    srcs = []
    for g in range(n_groups):
        p = [rng.randrange(vocab) for _ in range(prompt)]
        for i in range(m):
            toks = p + [rng.randrange(vocab) for _ in range(cont)]
            srcs.append(TrajectorySource(f"g{g}t{i}", f"g{g}", tuple(toks),
                                         tuple([0] * prompt + [1] * cont), rng.random(), 0,
                                         ready_order=rng.random()))
    return sorted(srcs, key=lambda s: s.ready_order)


def run(policy, cfg, srcs):
    learner = Learner(cfg.learner, policy)
    learner.begin(BatchPlan.from_sources(srcs))
    with FlopCounterMode(display=False) as fc:
        for s in srcs:
            learner.submit(s)
        # Count only learner compute up to the barrier (the step itself is identical).
        learner.batch.queue.close()
        while learner.serve_next():
            pass
    result = learner.close(export_grad=True)
    ledger = update_flops(policy.spec, result.trace)  # what the learner reports for MFU
    return fc.get_total_flops(), result.grad, ledger.total + ledger.recompute_flops


def main(hf_dir: str) -> None:
    out = {}
    par = None
    for schedule in ("thundersync", "sync"):
        for shared in (True, False):
            cfg = load_config(None, {"model.hf_dir": hf_dir, "learner.shared_prefix": shared,
                                     "learner.schedule": schedule, "learner.k_open": 2})
            policy = Policy(cfg, par=par)
            par = policy.par
            flops, grad, ledger = run(policy, cfg, batch(policy.vocab_size))
            out[f"{schedule}_{'on' if shared else 'off'}"] = (flops, grad)
            out[f"{schedule}_{'on' if shared else 'off'}_ledger_err"] = abs(ledger - flops) / flops
    res = {}
    for schedule in ("thundersync", "sync"):
        (f_on, g_on), (f_off, g_off) = out[f"{schedule}_on"], out[f"{schedule}_off"]
        res[schedule] = dict(flops_on=f_on, flops_off=f_off, saving=1 - f_on / f_off,
                             rel_l2_on_vs_off=rel_l2(g_on, g_off),
                             ledger_err_on=out[f"{schedule}_on_ledger_err"],
                             ledger_err_off=out[f"{schedule}_off_ledger_err"])
    emit(res)


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(sys.argv[1])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
