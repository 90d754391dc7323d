"""Evaluation of θ_k on data.eval between batches (run.eval_every), outside every step
time. `Evaluation` is a part of RolloutDriver (tsync_mcore.rollout.driver)."""

from __future__ import annotations

import json
import os
import time

from tsync_mcore.publication.receive import RolloutStopped
from tsync_mcore.rollout.batch import STOPS, _Batch
from tsync_mcore.util.safe_files import private_dir


class Evaluation:
    """RolloutDriver's evaluation; it uses the driver's feed, engine and agents."""

    def _eval_due(self, version: int) -> bool:
        every = self.cfg.run.eval_every
        return bool(every) and self.feed is not None and version % every == 0

    def _evaluate(self, version: int) -> None:
        """θ_version on data.eval, after its publication was acknowledged and before the
        next RegisterBatch: the learner's step clock starts at that registration, so
        evaluation is not in any step time. Results go into the next CloseBatch's metrics
        and, at once, to RUN/eval.jsonl (the last evaluation has no next batch)."""
        t0 = time.perf_counter()

        def agents(envs, seeds, rows, traj_ids, routes, kwargs):  # the batch's agents too
            b = _Batch(version, {}, rows, seeds, traj_ids, routes, rows)
            return self._agents(b, envs, kwargs, prompts=self.feed.eval)

        try:
            metrics = self.et.run(self.feed.evaluate(
                self.engine, version, agents=agents if self.oai is not None else None))
        except STOPS as e:
            raise RolloutStopped(f"evaluation of θ_{version}: {e}") from None
        finally:
            self.engine.take_metrics()  # the replicas' counts are training's only
        if self.oai is not None:  # and so are the endpoint's; the agents' failures are named
            self.oai.take_metrics()
            metrics["eval/agent_failures"] = self.agent_counters.take()["rollout/agent_failures"]
        metrics["eval/time_s"] = time.perf_counter() - t0
        metrics["eval/policy_version"] = version
        self.pending_metrics = metrics
        print(f"[rollout] eval θ_{version}: " + json.dumps(metrics), flush=True)
        private_dir(self.cfg.run.dir)
        with open(os.path.join(self.cfg.run.dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")
