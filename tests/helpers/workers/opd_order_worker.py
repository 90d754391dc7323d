"""An OPD learner behind the rollout: which turn it serves next, and what it holds.

Turns are handed over with submit(serve=False) and served one at a time with serve_next(),
as the trainer does when several arrived while it was busy. Reports the service order of a
scripted arrival pattern, the gradient against a sync learner over the same turns, and the
K/V peak of a whole batch handed over at once vs served in readiness order.
"""

import sys
from dataclasses import replace

from tests.helpers.batchgen import make_opd_batch  # noqa: E402
from tests.helpers.dist_util import emit  # noqa: E402
from tests.helpers.reference import rel_l2  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, opd_turns_from_json  # noqa: E402
from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner.policy import Policy  # noqa: E402
from tsync_mcore.learner.update import Learner  # noqa: E402


def batch(vocab: int, n_traj: int, seed: int):
    rows = make_opd_batch(vocab, n_traj=n_traj, turns=3, seed=seed, zero_scored_traj=False)
    turns = sorted([t for r in rows for t in opd_turns_from_json(r)], key=lambda t: t.ready_order)
    return BatchPlan.from_sources(turns), turns


def at(turns, version: int):
    """The same turns for a later update (lr 1e-30 leaves θ as it is in fp32, so the
    gradients compare)."""
    return [replace(t, policy_version=version) for t in turns]


def served(records) -> list[str]:
    """The served units among `records` (an open batch's, or a closed one's trace)."""
    entries = sorted((r for r in records if getattr(r, "kind", None) == "source" and r.served),
                     key=lambda r: r.start)
    return [f"{r.traj_id.split('-')[-1]}#{r.turn}" for r in entries]


def grad(result) -> dict:
    return {k: v.double() for k, v in result.grad.items()}


def main(hf_dir: str) -> None:
    # One turn per pass: the order checked here is among one-by-one services (packed
    # passes are tests/test_packed.py's), and ≤ 1e-12 needs the same per-turn FP32 pass.
    cfg = load_config(None, {"model.hf_dir": hf_dir, "learner.objective": "opd",
                             "learner.accum_dtype": "fp64", "optim.lr": 1e-30,
                             "learner.max_tokens_per_pass": 0})
    policy = Policy(cfg)
    learner = Learner(cfg.learner, policy)
    res = {}

    # Scripted: A0 B0 arrive; two services; then C0 A1 B1 arrive (in that order).
    plan, turns = batch(policy.vocab_size, 3, seed=11)
    by = {f"{t.traj_id.split('-')[-1]}#{t.turn}": t for t in turns}
    learner.begin(plan, schedule="thundersync")
    for k in ("o0#0", "o1#0"):
        learner.submit(by[k], serve=False)
    res["nothing_served_on_submit"] = served(learner.batch.records.values()) == []
    res["first_two"] = [learner.serve_next(), learner.serve_next()]
    for k in ("o2#0", "o0#1", "o1#1"):
        learner.submit(by[k], serve=False)
    while learner.serve_next():
        pass
    res["order"] = served(learner.batch.records.values())
    res["idle_serve_next"] = learner.serve_next()
    for k in ("o0#2", "o1#2", "o2#1", "o2#2"):  # close serves these
        learner.submit(by[k], serve=False)
    streamed = learner.close(export_grad=True)
    learner.begin(plan, schedule="sync")
    for t in at(turns, learner.version):
        learner.submit(t)
    reference = learner.close(export_grad=True)
    res["grad_vs_sync"] = rel_l2(grad(streamed), grad(reference))

    # A whole batch handed over at once vs served as each turn arrives (readiness order).
    plan, turns = batch(policy.vocab_size, 8, seed=12)
    grads = {}
    for mode in ("backlog", "readiness"):
        learner.begin(plan, schedule="thundersync")
        for t in at(turns, learner.version):
            learner.submit(t, serve=mode == "readiness")
        result = learner.close(export_grad=True)
        res[mode + "_kv_peak_bytes"] = result.summary.kv_peak_bytes
        grads[mode] = grad(result)
        trajs = [k.split("#")[0] for k in served(result.trace)]
        # how often the next service continues the trajectory just served
        res[mode + "_same_next"] = sum(a == b for a, b in zip(trajs, trajs[1:])) / (len(trajs) - 1)
    res["backlog_vs_readiness_grad"] = rel_l2(grads["backlog"], grads["readiness"])
    emit(res)


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(sys.argv[1])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
