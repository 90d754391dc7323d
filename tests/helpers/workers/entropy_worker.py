"""The learner's entropy metric at TP=2 (vocab-parallel logits), run in lm_head_worker.py's
launch (tests/integration/test_lm_head.py), or alone:

Usage: torchrun --nproc-per-node 2 tests/helpers/workers/entropy_worker.py '<json>'
json: {"hf_dir": dir, "rows": [{"tokens": [...], "scored_mask": [...]}, ...]}
Each rank serves every row through Policy.backward_source (the training path) and reports
its (Σ entropy, scored tokens) from Policy.take_entropy as one `RESULT {json}` line.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner.policy import Policy  # noqa: E402
from tsync_mcore.model.parallel import init_parallel  # noqa: E402


def measure(job: dict) -> dict:
    """This rank's (Σ entropy, scored tokens) of the job's rows, and what a second take
    reads (also run in lm_head_worker.py's launch, tests/integration/test_lm_head.py)."""
    cfg = load_config(None, {"model.hf_dir": job["hf_dir"], "model.tp": 2,
                             "rollout.n_learners": 2})
    par = init_parallel(tp_size=2)
    policy = Policy(cfg, par=par)
    for row in job["rows"]:
        policy.backward_source(row["tokens"], row["scored_mask"], 1.0)
        policy.zero_grads()
    ent_sum, n = policy.take_entropy()
    again = policy.take_entropy()  # taken means reset
    return {"tp_rank": par.tp_rank, "tp_size": par.tp_size, "entropy_sum": ent_sum,
            "tokens": n, "after_take": list(again)}


def main() -> None:
    report(measure(json.loads(sys.argv[1])))
    dist.barrier()


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main()
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
