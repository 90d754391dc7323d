"""One batch per case through the learner on 2 DP ranks, one fresh Policy at θ_0 each.

Usage: peer_objectives_worker.py HF_DIR CASES_JSON OUT_DIR
CASES_JSON: a list of {name, batch, overrides, routing}; rank 0 writes OUT_DIR/<name>.safetensors
(g_0 before clipping, HF names), every rank prints RESULT with each case's close summary.
"""

import json
import os
import sys

from safetensors.torch import save_file

from tests.helpers.dist_util import emit  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan
from tsync_mcore.config import load_config
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.replay import _feed, read_batches
from tsync_mcore.learner.update import Learner


def main(hf_dir: str, cases_path: str, out: str) -> None:
    with open(cases_path) as f:
        cases = json.load(f)
    par, res = None, {}
    for case in cases:
        cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-5, **case["overrides"]})
        policy = Policy(cfg, par=par)  # θ_0 again: every case differentiates the same model
        par = policy.par
        (sources,) = read_batches(case["batch"])
        plan = BatchPlan.from_sources(sources)
        tokens: dict[str, int] = {}
        for s in sources:
            tokens[s.group_id] = tokens.get(s.group_id, 0) + len(s.tokens)
        learner = Learner(cfg.learner, policy)
        learner.begin(plan, group_tokens=tokens, routing=case["routing"])
        _feed(learner, sources, plan, case["routing"], par)
        result = learner.close(export_grad=True)
        s = result.summary
        res[case["name"]] = dict(ok=s.ok, n_groups=s.n_groups, scored_tokens=s.scored_tokens,
                                 served_here=s.n_sources, token_norm=cfg.learner.token_norm)
        if par.rank == 0:
            save_file({n: v.float().contiguous() for n, v in result.grad.items()},
                      os.path.join(out, f"{case['name']}.safetensors"))
    emit({"rank": par.rank, "cases": res})


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(*sys.argv[1:4])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
