"""Evaluation of θ_k on data.eval between batches (run.eval_every), outside every step
time."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from tsync_mcore.config import Config
from tsync_mcore.publication.receive import RolloutStopped
from tsync_mcore.rollout.agents import Agents
from tsync_mcore.rollout.batch import STOPS
from tsync_mcore.rollout.engine import EngineThread
from tsync_mcore.rollout.feed import DataFeed
from tsync_mcore.rollout.plan import Batch
from tsync_mcore.util.safe_files import private_dir


class Evaluator:
    """Evaluates the policy `engine` serves on the feed's data.eval, through the training
    batches' `agents`; the results wait in `take_results()` for the next CloseBatch."""

    def __init__(self, cfg: Config, engine: Any, feed: DataFeed | None, agents: Agents,
                 et: EngineThread):
        self.cfg, self.engine, self.feed, self.agents, self.et = cfg, engine, feed, agents, et
        self.pending: dict[str, Any] = {}  # the last evaluation's, not yet reported

    def due(self, version: int) -> bool:
        """run.eval_every: is θ_version evaluated (a dataset run only)?"""
        every = self.cfg.run.eval_every
        return bool(every) and self.feed is not None and version % every == 0

    def take_results(self) -> dict[str, Any]:
        """The metrics of the evaluation since the last call ({} if none)."""
        out, self.pending = self.pending, {}
        return out

    def evaluate(self, version: int) -> None:
        """θ_version on data.eval, after its publication was acknowledged and before the
        next RegisterBatch: the learner's step clock starts at that registration, so
        evaluation is not in any step time. Results go into the next CloseBatch's metrics
        and, at once, to RUN/eval.jsonl (the last evaluation has no next batch)."""
        t0 = time.perf_counter()
        openai = self.agents.oai is not None

        def agents(envs, seeds, rows, traj_ids, routes, kwargs):  # the batch's agents too
            b = Batch(version, {}, rows, seeds, traj_ids, routes, rows)
            return self.agents.run(b, envs, kwargs, prompts=self.feed.eval)

        try:
            metrics = self.et.run(self.feed.evaluate(
                self.engine, version, agents=agents if openai else None))
        except STOPS as e:
            raise RolloutStopped(f"evaluation of θ_{version}: {e}") from None
        finally:
            self.engine.take_metrics()  # the replicas' counts are training's only
        if openai:  # and so are the endpoint's; the agents' failures are named
            metrics["eval/agent_failures"] = self.agents.take_metrics()["rollout/agent_failures"]
        metrics["eval/time_s"] = time.perf_counter() - t0
        metrics["eval/policy_version"] = version
        self.pending = metrics
        print(f"[rollout] eval θ_{version}: " + json.dumps(metrics), flush=True)
        private_dir(self.cfg.run.dir)
        with open(os.path.join(self.cfg.run.dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")
