"""The agent of rollout.env: verifiers:<module>: a verifiers environment's own rollout and
rubric, against the rollout's OpenAI-compatible endpoint.

    rollout.env: verifiers:my_env       (rollout.agent: openai; agent_command "": this agent)

The task (TSYNC_TASK, or a pool handout's) carries `verifiers: {env, args, split, row}`.
The agent loads `env.load_environment(**args)` once per process (a pool worker keeps it
across trajectories), takes row `row` of the env's `split` dataset (checking it is the
prompt the rollout rendered), runs `env.rollout(row, client, model, sampling_args)` with a
vf.OpenAIChatCompletionsClient over an AsyncOpenAI pointed at the trajectory's base URL,
scores the final state with the env's rubric, and posts `done {"reward": x}` — or
`done {"reward_error": why}` when a reward function raised or returned a non-number, which
the rollout handles under reward.on_error. The endpoint records every sampled id; the
learner trains on those.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import openai

from tsync_mcore.rollout import vf_env

_ENVS: dict[str, tuple[Any, list[str]]] = {}  # (module, args) → (env, its rubric's errors)


def environment(module: str, args: dict[str, Any]) -> tuple[Any, list[str]]:
    key = json.dumps([module, args], sort_keys=True)
    if key not in _ENVS:
        env = vf_env.load_env(module, args)
        _ENVS[key] = env, vf_env.guard_rubric(env.rubric)
    return _ENVS[key]


def _row(env: Any, spec: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    module, split, index = spec["env"], spec.get("split", "train"), int(spec["row"])
    ds = vf_env.VerifiersSet(module, env, split)
    if ds.ds is None or not 0 <= index < len(ds):
        raise RuntimeError(f"verifiers:{module} has no {split} row {index}")
    if vf_env.prompt_messages(ds.ds[index].get("prompt")) != messages:
        # the rollout rendered (and trains on) the prompt it read: an env whose dataset
        # differs between two loads (unseeded shuffling) cannot be trained this way
        raise RuntimeError(f"verifiers:{module} {split} row {index}: its prompt differs from "
                           f"the rollout's (the environment builds its dataset differently "
                           f"each time it is loaded)")
    return dict(ds.ds[index])


async def episode(client: openai.OpenAI, task: dict[str, Any]) -> dict[str, Any]:
    """One rollout and its score; the done body to post."""
    import verifiers as vf

    spec = task["verifiers"]
    env, errors = environment(spec["env"], spec.get("args") or {})
    row = _row(env, spec, task["messages"])
    sampling = {**(env.sampling_args or {}), "temperature": task.get("temperature", 1.0),
                "max_tokens": task.get("max_tokens_per_turn")}
    aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key,
                                 max_retries=0, timeout=client.timeout)
    try:
        state = await env.rollout(row, vf.OpenAIChatCompletionsClient(aclient),
                                  task.get("model", "tsync"), sampling)
        if state.get("error") is not None:  # e.g. the trajectory's token budget is spent
            print(f"[agent] rollout ended: {state['error']!r}"[:500], file=sys.stderr)
        try:
            reward, metrics = await vf_env.score(env, state, errors)
        except vf_env.ScoreError as e:
            return {"reward_error": str(e)[:2000]}
        finally:
            await env.rubric.cleanup(state)
        print(f"[agent] reward {reward} {json.dumps(metrics)}", file=sys.stderr)
        return {"reward": reward}
    finally:
        await aclient.close()


def run(client: openai.OpenAI, task: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(episode(client, task))


def main() -> int:
    from tsync_mcore.rollout.openai.agents import pool
    return pool.main(run)


if __name__ == "__main__":
    sys.exit(main())
