"""A batch whose reduced gradient is not finite, between two good ones (2 ranks).

Usage: nonfinite_worker.py HF_DIR OUT MODE CHECK   (MODE: poisoned | clean; CHECK: update |
source). poisoned: batches A, P, B, where P's group v1-g0 has rewards 0 and 1e-300 and
adv_eps is 1e-300, so its advantage scale 1/(σ+ε) overflows FP32; clean: A, B only. Rank 0
writes the final parameters to OUT/params_MODE.safetensors and every rank prints RESULT.
"""

import os
import sys
from dataclasses import replace

from safetensors.torch import save_file

from tests.helpers.batchgen import make_batch  # noqa: E402
from tests.helpers.dist_util import emit  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, TrajectorySource  # noqa: E402
from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner.policy import Policy  # noqa: E402
from tsync_mcore.learner.update import Learner  # noqa: E402


def batch(version: int, seed: int, poison: bool = False) -> list[TrajectorySource]:
    srcs = [TrajectorySource.from_json(r) for r in sorted(
        make_batch(256, n_groups=3, m=3, version=version, seed=seed),
        key=lambda r: r["ready_order"])]
    if poison:  # a group with rewards 0, 1e-300, 0: σ ≈ 5e-301, so 1/(σ+ε) ≈ 1e300
        g = srcs[0].group_id
        members = [s.traj_id for s in srcs if s.group_id == g]
        srcs = [replace(s, reward=1e-300 if s.traj_id == members[1] else 0.0)
                if s.group_id == g else s for s in srcs]
    return srcs


def main(hf_dir: str, out: str, mode: str, check: str) -> None:
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-3, "learner.adv_eps": 1e-300,
                             "learner.check_finite": check})
    policy = Policy(cfg)
    learner = Learner(cfg.learner, policy)
    plan = [("A", batch(0, 1)), ("P", batch(1, 2, poison=True)), ("B", batch(1, 3))]
    results = []
    for name, srcs in plan:
        if mode == "clean" and name == "P":
            continue
        learner.begin(BatchPlan.from_sources(srcs))
        for s in srcs:
            learner.submit(replace(s, policy_version=learner.version))
        r = learner.close().summary
        results.append(dict(batch=name, ok=r.ok, grad_norm=r.grad_norm, version=learner.version,
                            nonfinite=r.nonfinite_sources))
    if policy.par.rank == 0:
        params = policy.export_params()
        save_file({k: v.contiguous() for k, v in params.items()},
                  os.path.join(out, f"params_{mode}_{check}.safetensors"))
    emit({"rank": policy.par.rank, "results": results})


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(*sys.argv[1:5])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
