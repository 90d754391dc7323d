"""The learner in this process (one rank, TP = 1): build one from config keys, run one
update on sources handed over as they would arrive (test_regularizers, test_ppo_minibatches,
test_segments, test_dynamic_sampling)."""

from __future__ import annotations


def make_learner(par, hf_dir, **learner):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    model = learner.pop("model", {})
    lr = learner.pop("lr", 1e-30)  # at 1e-30 the step leaves θ as it was: reusable
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": lr, **model,
                             **{f"learner.{k}": v for k, v in learner.items()}})
    return Learner(cfg.learner, Policy(cfg, par=par))


def run_update(learner, sources, chunk: int = 1):
    """One update; `chunk` > 1: sources handed over `chunk` at a time before serving, so
    what arrived together packs (pair passes of one incomplete group among them)."""
    from tsync_mcore.channel.sources import BatchPlan
    learner.begin(BatchPlan.from_sources(sources))
    for i in range(0, len(sources), chunk):
        for s in sources[i:i + chunk]:
            learner.submit(s, serve=False)
        while learner.serve_next():
            pass
    return learner.close(export_grad=True)


def as_sources(rows, version: int = 0):
    """The rows as sources of update `version` (a learner reused across updates)."""
    from tsync_mcore.channel.sources import TrajectorySource
    order = sorted(rows, key=lambda r: r["ready_order"])
    return [TrajectorySource.from_json({**{k: v for k, v in r.items() if k != "update"},
                                        "policy_version": version}) for r in order]
