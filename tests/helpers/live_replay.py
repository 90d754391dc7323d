"""A live run's θ against the sync update replayed, in the test process on one rank, from
what its learners received (run.save_sources): the check the live tests of dynamic
sampling, segments and replica restarts share."""

from __future__ import annotations

import json
import os


def saved_sources(run: str) -> list[dict]:
    """Every line the learner ranks wrote to RUN/sources, in (update, arrival) order."""
    lines = [json.loads(line) for name in os.listdir(f"{run}/sources")
             for line in open(f"{run}/sources/{name}")]
    return sorted(lines, key=lambda o: (o["update"], o["ready_order"]))


def sync_learner(config: str, par):
    """The run's config under the sync schedule, as a Learner on `par`."""
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    sync = load_config(config, {"learner.schedule": "sync"})
    return Learner(sync.learner, Policy(sync, par=par))


def replay_update(learner, lines: list[dict], export_grad: bool = False):
    """One update of `learner` on these saved lines; returns (its UpdateResult, θ after
    it in FP64 by name)."""
    from tsync_mcore.channel.sources import BatchPlan, TrajectorySource
    srcs = [TrajectorySource.from_json({k: v for k, v in o.items() if k != "update"})
            for o in lines]
    learner.begin(BatchPlan.from_sources(srcs))
    for src in srcs:
        learner.submit(src)
    res = learner.close(export_grad=export_grad)
    return res, {k: v.double() for k, v in learner.policy.export_params().items()}


def gap_over_moved(theta_file: str, want: dict, before: dict) -> tuple[float, float]:
    """(‖θ_live − want‖ / ‖want − before‖, ‖want − before‖): the live run's distance from
    the replayed update, relative to how far that update moved θ."""
    from safetensors.torch import load_file
    theta = load_file(theta_file)
    moved = sum(float(((want[k] - before[k].double()) ** 2).sum()) for k in want) ** 0.5
    gap = sum(float(((theta[k].double() - want[k]) ** 2).sum()) for k in want) ** 0.5
    return (gap / moved if moved else float("inf")), moved
