"""Who runs a batch's trajectories: the built-in agent loop on the engine (rollout.loop),
or with rollout.agent: openai one agent process each talking to the OpenAI-compatible
endpoint (rollout.openai, docs/guide/agents.md) that this module starts and stops."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from tsync_mcore.config import Config
from tsync_mcore.publication.receive import RolloutStopped
from tsync_mcore.rollout.engine import EngineThread
from tsync_mcore.rollout.envs import ToyToolEnv
from tsync_mcore.rollout.feed import DataFeed
from tsync_mcore.rollout.loop import run_batch
from tsync_mcore.rollout.plan import Batch
from tsync_mcore.rollout.types import TrajectoryResult


class Agents:
    """The trajectories' runners on `engine`; `served()` is the policy version it serves
    (what an agent's trajectory starts with)."""

    def __init__(self, cfg: Config, engine: Any, tok: Any, feed: DataFeed | None,
                 et: EngineThread, served: Callable[[], int]):
        self.cfg, self.rc = cfg, cfg.rollout
        self.engine, self.tok, self.feed, self.et, self.served = engine, tok, feed, et, served
        self.oai = self.counters = self.pool = None

    def start_endpoint(self) -> None:
        """rollout.agent: openai: the OpenAI-compatible endpoint on the engine's loop
        (docs/guide/agents.md), with a random key for this run."""
        from tsync_mcore.rollout.openai.launch import AgentIsolationError, Launcher
        from tsync_mcore.rollout.openai.processes import AgentCounters
        from tsync_mcore.rollout.openai.server import OpenAIServer

        rc = self.rc
        try:  # `require` where the jail cannot be made, an agent_expose showing the run dir
            Launcher(None, rc.agent_isolation, expose=rc.agent_expose, hide=(self.cfg.run.dir,))
        except AgentIsolationError as e:
            raise RolloutStopped(str(e)) from None
        self.oai = OpenAIServer(self.engine, self.tok, api_key=secrets.token_urlsafe(24),
                                model=os.path.basename(os.path.normpath(self.cfg.model.hf_dir)),
                                history=rc.openai_history, temperature=rc.temperature,
                                current_version=self.served,
                                max_body_bytes=int(rc.openai_max_body_mb * (1 << 20)),
                                max_messages=rc.openai_max_messages,
                                read_timeout_s=rc.openai_read_timeout_s,
                                max_connections=rc.openai_max_connections)
        self.counters = AgentCounters()
        host, _, port = rc.serve_openai.rpartition(":")
        try:
            host, port = self.et.run(self.oai.start(host.strip("[]"), int(port)))
        except OSError as e:
            raise RolloutStopped(f"rollout.serve_openai: cannot serve on "
                                 f"{rc.serve_openai}: {e}") from None
        print(f"[rollout] OpenAI-compatible endpoint at http://{host}:{port}/t/<trajectory>/v1",
              flush=True)

    def take_metrics(self) -> dict[str, float]:
        """The endpoint's and the agents' counters since the last call ({} without agents)."""
        if self.oai is None:
            return {}
        return {**self.oai.take_metrics(), **self.counters.take()}

    def run(self, batch: Batch, envs: list, kwargs: dict, prompts: Any = None
            ) -> AsyncIterator[tuple[int, TrajectoryResult | None]]:
        """The batch's trajectories as they finish, (index, result): the built-in loop, or
        one agent process each talking to the endpoint (rollout.agent: openai). `prompts`:
        the PromptSet of `batch.rows` (default: data.train; evaluation passes data.eval)."""
        if self.oai is None:
            return run_batch(self.engine, envs, seeds=batch.seeds, env_seeds=batch.env_seeds,
                             routes=batch.group_of, **kwargs)
        return self._run_agents(batch, envs, kwargs, prompts)

    def _run_agents(self, batch: Batch, envs: list, kwargs: dict, prompts: Any
                    ) -> AsyncIterator[tuple[int, TrajectoryResult]]:
        from tsync_mcore.rollout.openai.pool import AgentPool
        from tsync_mcore.rollout.openai.processes import (DEFAULT_COMMAND, TERMINAL_COMMAND,
                                                          VERIFIERS_COMMAND, run_agents)

        rc, feed = self.rc, self.feed
        limits = dict(max_turns=rc.max_turns, max_tokens_per_turn=rc.max_tokens_per_turn,
                      max_total_tokens=rc.max_total_tokens, max_segments=rc.max_segments,
                      max_trained_tokens=rc.max_trained_tokens)
        tools = None
        if feed is not None:  # rollout.env: dataset: the row's chat messages
            from tsync_mcore.data import row_messages
            rows = prompts or feed.train
            messages = [row_messages(rows.row(r), self.cfg.data.system_prompt)
                        for r in batch.rows]
        elif rc.env == "terminal":  # each episode's repo, its tools run there
            messages = [env.start(seed) for env, seed in zip(envs, batch.env_seeds)]
            tools = [env.box for env in envs]
        else:
            messages = [ToyToolEnv.task_messages(seed) for seed in batch.env_seeds]
        tasks = [{"messages": m, "model": self.oai.model,
                  "temperature": kwargs.get("temperature", rc.temperature), **limits}
                 for m in messages]
        vf = feed.vf if feed is not None else None
        if vf is not None:  # the agent runs the env's rollout on this row of its dataset
            split = "eval" if prompts is not None and prompts is feed.eval else "train"
            for t, r in zip(tasks, batch.rows):
                t["verifiers"] = {"env": vf, "args": self.cfg.verifiers.args,
                                  "split": split, "row": r}

        def reward_error(i: int, why: str) -> float:
            """Trajectory i's agent could not score it: reward.on_error decides."""
            env = envs[i]
            if hasattr(env, "reward_error"):
                return env.reward_error(why)
            from tsync_mcore.rewards import RewardFailed
            msg = f"the agent's reward on trajectory {batch.traj_ids[i]}: {why}"
            if self.cfg.reward.on_error == "fail":
                raise RewardFailed(msg)
            print(f"[rollout] {msg}; scored 0", flush=True)
            return 0.0

        async def task_reward(i: int, actions: list[list[int]]) -> float:
            """The task's reward from the recorded actions, when the agent posted none."""
            env = envs[i]
            if tools is not None:  # the hidden tests on what the agent left in the repo
                return await env.verify()
            env.reset(batch.env_seeds[i])
            if feed is not None:  # reward.function on the final answer's text
                await env.step(actions[-1])
            else:  # the toy env sees every completion, as in the built-in loop
                for a in actions:
                    env.account(a)
            return env.reward()

        command = rc.agent_command or (TERMINAL_COMMAND if rc.env == "terminal" else
                                       VERIFIERS_COMMAND if vf is not None else DEFAULT_COMMAND)
        if rc.agent_pool and self.pool is None:  # started with the first batch, kept
            self.pool = AgentPool(self.oai, command=command, size=rc.agent_pool,
                                  run_dir=self.cfg.run.dir, timeout_s=rc.agent_timeout_s,
                                  counters=self.counters, pass_env=rc.agent_env,
                                  isolation=rc.agent_isolation, expose=rc.agent_expose)
        return run_agents(self.oai, traj_ids=batch.traj_ids, group_of=batch.group_of,
                          tasks=tasks, seeds=batch.seeds, version=self.served(), limits=limits,
                          command=command, pool=self.pool, timeout_s=rc.agent_timeout_s,
                          failed_reward=rc.agent_failed_reward,
                          concurrency=rc.agent_concurrency, task_reward=task_reward,
                          run_dir=self.cfg.run.dir, counters=self.counters, tools=tools,
                          max_calls_per_turn=self.cfg.tools.max_calls_per_turn,
                          pass_env=rc.agent_env, on_reward_error=reward_error,
                          isolation=rc.agent_isolation, expose=rc.agent_expose)

    def stop(self) -> None:
        """The pool (410 to its pollers, SIGTERM, SIGKILL after a grace), then the endpoint."""
        if self.pool is not None:
            try:
                self.et.run(self.pool.stop(), timeout=30)
            except Exception as e:
                print(f"[rollout] stopping the agent pool: {e}", flush=True)
        if self.oai is not None:
            try:
                self.et.run(self.oai.stop(), timeout=20)
            except Exception as e:
                print(f"[rollout] stopping the OpenAI endpoint: {e}", flush=True)
