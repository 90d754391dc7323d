"""Shared by the tests of predict: tests/unit/test_predict.py, tests/integration/test_predict.py."""

from __future__ import annotations

import json

from tests.helpers.paths import ROOT
from tests.helpers.records import source
from tsync_mcore.observability import trace


REPO = ROOT


def close_to(value: float, paper: float) -> bool:
    """The paper rounds to 2 decimals: the value must round to the quoted figure."""
    return abs(value - paper) <= 0.005 + 1e-12


def write_run(root) -> str:
    """Two ranks, three updates. Update k: R = 4, publish 0.5, learner tail 1.0, step wall
    5.5 (so t_closed = 4.0 and t_stepped = 5.0 on rank 0's clock)."""
    run = root / "run"
    (run / "traces").mkdir(parents=True)
    metrics, traces = [], {0: [], 1: []}
    for k in range(3):
        metrics.append(dict(step=k + 1, policy_version=k, schedule="thundersync",
                            objective="grpo", step_wall_time_s=5.5 + k, rollout_time_s=4.0,
                            learner_tail_s=1.0, publish_time_s=0.5))
        # rank 0: 1 + 1 back to back ending at 3.6 + 1.0 = 4.6; rank 1: light
        traces[0] += [source(update=k, traj_id=f"v{k}-g0-t0", ready=0.5, start=0.5, end=1.5),
                      source(update=k, traj_id=f"v{k}-g0-t1", ready=3.6, start=3.6, end=4.6)]
        traces[1] += [source(update=k, traj_id=f"v{k}-g1-t0", rank=1, ready=2.0, start=2.0,
                             end=2.5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    for r, es in traces.items():
        trace.write(str(run / "traces" / f"rank{r}.jsonl"), es)
    return str(run)
