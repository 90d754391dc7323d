"""Agents as separate processes (rollout.agent: openai): one process per trajectory (or,
rollout.agent_pool > 0, a handout to a pool of long-lived workers: pool.py), each
talking to the rollout's OpenAI-compatible endpoint (server.py), with the endpoint's
address and its trajectory id in its environment:

    OPENAI_BASE_URL      http://HOST:PORT/t/<trajectory id>/v1
    OPENAI_API_KEY       this trajectory's own key (valid for its routes, while it is open)
    TSYNC_TRAJECTORY_ID  the trajectory id;  TSYNC_GROUP_ID  its GRPO group
    TSYNC_TASK           the task as JSON: {"messages": [...], "max_turns", "max_tokens_per_turn",
                         "temperature", "model"} (+ "tools": their OpenAI schemas)
    TSYNC_TOOLS_URL      a task with tools (rollout.env: terminal): POST <url>/<name>
                         {"arguments": {...}} runs one in the episode's sandbox

The trajectory is registered on the server before its process starts, and closed when the
process exits or is killed (its whole process group) after rollout.agent_timeout_s; the
trajectory is then built from the server's record (`Session.result`), so the learner trains
on the ids vLLM sampled. A process that exits non-zero or times out gives a failed
trajectory: rollout.agent_failed_reward, counted (rollout/agent_failures). The reward is the
one the agent posted, else the task's: the toy task's from the recorded actions,
(rollout.env: dataset) reward.function on the last completion's text, or (terminal) the
verifier's on the episode's repo, which takes no posted reward.
An agent that posts `done {"error": ...}` fails its trajectory too (status "failed"); one
that posts `done {"reward_error": ...}` ran its episode but could not score it:
`on_reward_error(i, why)` gives the reward (reward.on_error: 0, counted, or it raises).
Run as root, each agent process (each pool worker) runs in the jail (launch.py,
rollout.agent_isolation): its own uid and namespaces, the run directory hidden, the endpoint
reached through the forwarder at http://127.0.0.1:8000 (its OPENAI_BASE_URL's host).
Each trajectory's record goes to RUN/agent/records.jsonl; a failed agent's output is kept in
RUN/agent/logs/<trajectory id>.log (a pool worker's: RUN/agent/pool/worker<k>.log).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from tsync_mcore.rollout.loop import as_finished
from tsync_mcore.rollout.openai.launch import Launcher
from tsync_mcore.rollout.openai.pool import AgentPool, agent_env
from tsync_mcore.rollout.openai.server import OpenAIServer
from tsync_mcore.rollout.types import TrajectoryResult

DEFAULT_COMMAND = f"{shlex.quote(sys.executable)} -m tsync_mcore.rollout.openai.agents.digits"
# rollout.env: terminal: the bundled function-calling agent (tools through the endpoint)
TERMINAL_COMMAND = f"{shlex.quote(sys.executable)} -m tsync_mcore.rollout.openai.agents.terminal"
# rollout.env: verifiers:<module>: the env's own rollout and rubric (agents/verifiers.py)
VERIFIERS_COMMAND = (f"{shlex.quote(sys.executable)} -m "
                     f"tsync_mcore.rollout.openai.agents.verifiers")


class AgentCounters:
    def __init__(self) -> None:
        self.failures = self.timeouts = self.crashes = self.errors = self.restarts = 0

    def take(self) -> dict[str, float]:
        out = {"rollout/agent_failures": float(self.failures),
               "rollout/agent_timeouts": float(self.timeouts),
               "rollout/agent_crashes": float(self.crashes),
               "rollout/agent_errors": float(self.errors),
               "rollout/agent_restarts": float(self.restarts)}
        self.failures = self.timeouts = self.crashes = self.errors = self.restarts = 0
        return out


async def run_agent(command: str, env: dict[str, str], timeout_s: float, log_path: str,
                    launcher: Launcher | None = None) -> tuple[str, int | None]:
    """Run `command` (a shell command) by `launcher` (default: as this process's user, in
    its own process group); ("ok" | "crashed" | "timed out", exit code). On timeout or
    cancellation the whole agent (its group, or its jail) is killed."""
    if os.path.exists(log_path):
        os.remove(log_path)
    proc = await (launcher or Launcher(None, "none")).start(command, env, log_path)
    try:
        code = await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return "timed out", None
    except BaseException:  # cancelled: never leave an agent behind
        proc.kill()
        raise
    finally:
        if proc.returncode is None:
            proc.kill()
    if code == 0:
        # the shell is gone; anything it left running in its group goes too
        proc.kill()
        return "ok", 0
    return "crashed", code


async def run_agents(
    server: OpenAIServer,
    *,
    traj_ids: Sequence[str],
    group_of: Sequence[str],
    tasks: Sequence[dict[str, Any]],
    seeds: Sequence[int | None],
    version: int,
    limits: dict[str, int],
    command: str,
    timeout_s: float,
    failed_reward: float,
    concurrency: int,
    task_reward: Callable[[int, list[list[int]]], Awaitable[float]],
    run_dir: str,
    counters: AgentCounters,
    tools: Sequence[Any] | None = None,
    max_calls_per_turn: int = 4,
    pool: AgentPool | None = None,
    pass_env: Sequence[str] = (),
    on_reward_error: Callable[[int, str], float] | None = None,
    isolation: str = "isolate",
    expose: Sequence[str] = (),
) -> AsyncIterator[tuple[int, TrajectoryResult]]:
    """Run every trajectory by an agent; yield (index, result) as each one ends. Without
    `pool` one process of `command` per trajectory, with it a handout to the pool's
    long-lived workers (`command` is then the pool's). `task_reward(i, actions)` is
    trajectory i's reward from its sampled actions when the agent posted none. `tools[i]`:
    trajectory i's ToolBox (or None), served to its agent. An agent process sees only
    `agent_env(pass_env)` of the rollout's environment; it runs jailed by `isolation`
    (launch.py; a pool's workers by the pool's), seeing `expose` but not `run_dir`."""
    launcher = pool.launcher if pool is not None else Launcher(
        server, isolation, expose=expose, hide=(run_dir,))
    sem = asyncio.Semaphore(concurrency or len(traj_ids) or 1)
    agent_dir = os.path.join(run_dir, "agent")
    os.makedirs(agent_dir, exist_ok=True)
    records = open(os.path.join(agent_dir, "records.jsonl"), "a")
    for i, tid in enumerate(traj_ids):  # every trajectory exists before any agent starts
        server.register(tid, version=version, seed=seeds[i], route=group_of[i],
                        tools=tools[i] if tools else None,
                        max_calls_per_turn=max_calls_per_turn, **limits)
    if pool is not None:
        await pool.start()  # once: its workers live across batches

    async def process(i: int, task: dict[str, Any]) -> tuple[str, int | None, str]:
        """Trajectory i by its own process, the task in its environment."""
        tid = traj_ids[i]
        env = agent_env(pass_env, OPENAI_BASE_URL=launcher.base_url(tid),
                        OPENAI_API_KEY=server.trajectory_key(tid), TSYNC_TRAJECTORY_ID=tid,
                        TSYNC_GROUP_ID=group_of[i], TSYNC_TASK=json.dumps(task))
        if "tools" in task:
            env["TSYNC_TOOLS_URL"] = launcher.base_url(tid) + "/tools"
        log = os.path.join(agent_dir, "logs", f"{tid}.log")
        status, code = await run_agent(command, env, timeout_s, log, launcher)
        return status, code, log

    async def handout(i: int, task: dict[str, Any]) -> tuple[str, int | None, str]:
        """Trajectory i handed to a pool worker (the same content, as JSON)."""
        tid = traj_ids[i]
        h = {"trajectory": tid, "base_url": launcher.base_url(tid),
             "api_key": server.trajectory_key(tid), "task": task}
        if "tools" in task:
            h["tools_url"] = launcher.base_url(tid) + "/tools"
        return await pool.run(tid, h, timeout_s)

    launch = process if pool is None else handout

    async def one(i: int) -> tuple[int, TrajectoryResult]:
        tid = traj_ids[i]
        task = {**tasks[i], "trajectory": tid, "group": group_of[i]}
        if tools and tools[i] is not None:
            task["tools"] = tools[i].schemas()
        t0 = time.monotonic()
        async with sem:
            status, code, log = await launch(i, task)
        t1 = time.monotonic()
        s = server.close(tid, f"its agent {status}")
        await server.settle(tid)  # a request in flight finishes (or sees `closed`)
        error = server.done.get(tid)
        reward_error = server.reward_errors.get(tid)
        if status == "ok" and reward_error is not None and on_reward_error is None:
            error = f"its reward: {reward_error}"  # nobody here to decide: a failure
        if status == "ok" and error is not None:  # the agent reported a failure
            status = "failed"
        if status == "ok":
            if pool is None:
                os.remove(log)
            if reward_error is not None:  # on_error: fail raises (the rollout stops)
                reward = on_reward_error(i, reward_error)
            else:
                reward = s.reward if s.reward is not None else (
                    await task_reward(i, s.actions()) if s.n_turns else failed_reward)
        else:
            counters.failures += 1
            if status == "timed out":
                counters.timeouts += 1
            elif status == "failed":
                counters.errors += 1
            else:
                counters.crashes += 1
            reward = failed_reward
            why = f": {error[:300]}" if status == "failed" else (
                "" if code is None else f" (exit code {code})")
            print(f"[rollout] agent of {tid} {status}{why}; failed trajectory, "
                  f"reward {failed_reward}; its output: {log}", flush=True)
        res = s.result(reward, "agent_exit" if status == "ok" else f"agent {status}",
                       wall_s=t1 - t0, t_start=t0, t_end=t1)
        res.extra.update(agent_status=status, rewrites=s.rewrites, segments=len(s.segments) + 1)
        rec = s.record(group_id=group_of[i], reward=reward, status=status, exit_code=code)
        rec["jailed"] = launcher.jailed  # its agent ran in the jail (launch.py)
        if error is not None:
            rec["error"] = error
        if reward_error is not None:
            rec["reward_error"] = reward_error
        records.write(json.dumps(rec) + "\n")
        records.flush()
        server.forget(tid)
        return i, res

    try:
        async for done in as_finished([one(i) for i in range(len(traj_ids))]):
            yield done
    finally:
        for tid in traj_ids:
            server.forget(tid)
        records.close()
