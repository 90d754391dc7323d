"""Multi-turn agent loop: model turn → tool call → observation → next turn, in token ids.

Layout of a trajectory with n turns (a_j: generated action, o_j: observation):

    prompt a_0 | o_0 a_1 | o_1 a_2 | ... | o_{n-2} a_{n-1}
    turn_ends:  ^end of turn 0  ^turn 1 ...           ^= len(tokens)

Actions are scored (mask 1), prompt and observations are not, so every turn starts with
unscored tokens (its observation, or the prompt for turn 0), as the learner requires. The
observation that follows the last action is never appended.

`run_batch` runs many trajectories concurrently on one engine and yields each as it
finishes: a slow tool call stalls only its own trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from tsync_mcore.rollout.engine import GenOut
from tsync_mcore.rollout.envs import AgentEnv
from tsync_mcore.rollout.openai.session import Session, SessionError
from tsync_mcore.rollout.types import TrajectoryResult, turn_seed

# on_turn(turn_index, tokens_so_far, turn_start, turn_end, scored_mask_so_far,
# logprobs_so_far, token_versions_so_far); may be async.
T = TypeVar("T")
TurnCallback = Callable[..., Awaitable[None] | None]


class Generator(Protocol):
    """What the agent needs from an engine (`RolloutEngine`, `ReplicaSet` (which also takes
    `route=`), or a test double)."""

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int,
                       temperature: float = 1.0, seed: int | None = None) -> GenOut: ...


async def _maybe_await(x: Awaitable[None] | None) -> None:
    if inspect.isawaitable(x):
        await x


def _check_budgets(engine: Generator, max_turns: int, max_tokens_per_turn: int,
                   max_total_tokens: int) -> None:
    """The loops' budgets are positive and fit the engine's context."""
    if max_turns < 1 or max_tokens_per_turn < 1:
        raise ValueError("max_turns and max_tokens_per_turn must be >= 1")
    limit = getattr(engine, "max_model_len", None)
    if limit is not None and max_total_tokens > limit:
        raise ValueError(f"max_total_tokens={max_total_tokens} exceeds the engine's "
                         f"max_model_len={limit}")


async def run_trajectory(
    engine: Generator,
    env: AgentEnv,
    *,
    max_turns: int,
    max_tokens_per_turn: int,
    max_total_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    env_seed: int | None = None,
    step_timeout_s: float | None = None,
    on_turn: TurnCallback | None = None,
    route: str | None = None,
) -> TrajectoryResult:
    """Roll out one episode of `env` with `engine` (anything with `RolloutEngine.generate`).

    `seed` seeds sampling (per turn, derived); `env_seed` (default `seed`, or 0) picks the
    task: members of a GRPO group share `env_seed` and differ in `seed`. `max_total_tokens`
    bounds the whole sequence (prompt included): a turn never samples past it, and an
    observation that would reach it ends the trajectory instead. `step_timeout_s` guards
    against a hung env: on expiry the env's `timeout_observation` is appended. `route`
    (optional) goes with every turn's request: an engine with replicas (`ReplicaSet`) sends
    the requests of one key to one replica, where their prefix is cached.
    """
    _check_budgets(engine, max_turns, max_tokens_per_turn, max_total_tokens)
    t_start = time.monotonic()
    prompt = list(env.reset(env_seed if env_seed is not None else (seed or 0)))
    if not prompt:
        raise ValueError("env.reset returned an empty prompt")
    if len(prompt) >= max_total_tokens:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_total_tokens="
                         f"{max_total_tokens}")
    tokens, mask = list(prompt), [0] * len(prompt)
    logprobs: list[float | None] = [None] * len(prompt)
    turn_ends: list[int] = []
    finish: list[str] = []
    versions: list[int] = []
    token_versions: list[int | None] = [None] * len(prompt)
    gen_s = tool_s = 0.0
    n_timeouts = 0
    stop_reason = "max_turns"
    turn_start = 0
    for turn in range(max_turns):
        budget = min(max_tokens_per_turn, max_total_tokens - len(tokens))
        t0 = time.monotonic()
        out = await engine.generate(tokens, max_tokens=budget, temperature=temperature,
                                    seed=turn_seed(seed, turn),
                                    **({} if route is None else {"route": route}))
        gen_s += time.monotonic() - t0
        action = list(out.token_ids)
        tokens += action
        mask += [1] * len(action)
        logprobs += list(out.logprobs)
        token_versions += list(out.token_versions) or [out.policy_version] * len(action)
        turn_ends.append(len(tokens))
        finish.append(out.finish_reason)
        versions.append(out.policy_version)
        if on_turn is not None:  # the turn is final now: OPD can score and release it
            await _maybe_await(on_turn(turn, list(tokens), turn_start, len(tokens), list(mask),
                                       list(logprobs), list(token_versions)))
        # The env sees every action, the last one included: the reward may depend on it.
        obs, done, dt, timed_out = await _step(env, action, step_timeout_s)
        tool_s += dt
        n_timeouts += timed_out
        if done:
            stop_reason = "done"
            break
        if turn == max_turns - 1:
            break
        if len(tokens) + len(obs) >= max_total_tokens:
            # No room to generate after the observation: end at the last action.
            stop_reason = "max_total_tokens"
            break
        if not obs:
            raise ValueError(f"env returned an empty observation at turn {turn} without done: "
                             f"the next turn would start with a scored token")
        turn_start = len(tokens)
        tokens += obs
        mask += [0] * len(obs)
        logprobs += [None] * len(obs)
        token_versions += [None] * len(obs)
    t_end = time.monotonic()
    return TrajectoryResult(
        tokens=tokens, scored_mask=mask, turn_ends=turn_ends, reward=float(env.reward()),
        prompt_len=len(prompt), n_turns=len(turn_ends), logprobs=logprobs,
        finish_reasons=finish, policy_versions=versions, token_versions=token_versions,
        stop_reason=stop_reason,
        n_timeouts=n_timeouts, gen_s=gen_s, tool_s=tool_s, wall_s=t_end - t_start,
        t_start=t_start, t_end=t_end)


async def run_rendered(
    engine: Generator,
    env: Any,
    *,
    tokenizer: Any,
    max_turns: int,
    max_tokens_per_turn: int,
    max_total_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    env_seed: int | None = None,
    step_timeout_s: float | None = None,
    on_turn: TurnCallback | None = None,
    route: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> TrajectoryResult:
    """`run_trajectory` over chat messages (rollout.render: template): every turn's prompt
    is the chat template rendered over the conversation so far — what the model sees when
    it is deployed — recorded id for id by the OpenAI endpoint's `Session`. A template that
    rewrites earlier turns (Qwen3 drops their reasoning) makes a prompt that does not extend
    the record: a new segment starts there, and every segment trains. The env gives
    messages: `task_messages(seed)`, `await step_messages(action_ids)`,
    `timeout_messages(action_ids)` (ToyToolEnv)."""
    if on_turn is not None:
        raise ValueError("rollout.render: template cannot release OPD turns (a turn of a "
                         "rewritten history has no single context); use render: tokens")
    _check_budgets(engine, max_turns, max_tokens_per_turn, max_total_tokens)
    t_start = time.monotonic()
    es = env_seed if env_seed is not None else (seed or 0)
    env.reset(es)
    messages = list(env.task_messages(es))
    s = Session(tokenizer, "", seed=seed, max_turns=max_turns,
                max_tokens_per_turn=max_tokens_per_turn, max_total_tokens=max_total_tokens)
    gen_s = tool_s = 0.0
    n_timeouts = 0
    stop_reason = "max_turns"
    for turn in range(max_turns):
        try:
            p = s.plan_chat(messages, kwargs=template_kwargs)
        except SessionError:  # the rendered prompt leaves no room to generate
            stop_reason = "max_total_tokens"
            break
        t0 = time.monotonic()
        out = await engine.generate(p.prompt_ids, max_tokens=p.max_tokens,
                                    temperature=temperature, seed=turn_seed(seed, turn),
                                    **({} if route is None else {"route": route}))
        gen_s += time.monotonic() - t0
        answer = {"role": "assistant",
                  "content": tokenizer.decode(out.token_ids, skip_special_tokens=True)}
        s.commit(p, out, answer)
        messages.append(answer)
        t0 = time.monotonic()
        try:
            obs, done = await asyncio.wait_for(env.step_messages(list(out.token_ids)),
                                               step_timeout_s)
        except asyncio.TimeoutError:
            obs, done = env.timeout_messages(list(out.token_ids))
            n_timeouts += 1
        tool_s += time.monotonic() - t0
        if done:
            stop_reason = "done"
            break
        if turn == max_turns - 1:
            break
        messages += obs
    if not s.n_turns:
        raise ValueError(f"the task's rendered prompt does not fit max_total_tokens="
                         f"{max_total_tokens}")
    t_end = time.monotonic()
    return s.result(float(env.reward()), stop_reason, n_timeouts=n_timeouts, gen_s=gen_s,
                    tool_s=tool_s, wall_s=t_end - t_start, t_start=t_start, t_end=t_end)


async def _step(env: AgentEnv, action: list[int], timeout: float | None
                ) -> tuple[list[int], bool, float, int]:
    """env.step under the agent's time limit; returns (obs, done, seconds, timed_out)."""
    t0 = time.monotonic()
    try:
        obs, done = await asyncio.wait_for(env.step(action), timeout)
        timed_out = 0
    except asyncio.TimeoutError:
        obs, done = env.timeout_observation(action)
        timed_out = 1
    return list(obs), bool(done), time.monotonic() - t0, timed_out


async def run_batch(
    engine: Generator,
    envs: Sequence[AgentEnv],
    *,
    seeds: Sequence[int | None],
    env_seeds: Sequence[int | None] | None = None,
    on_turn: Callable[[int], TurnCallback] | None = None,
    routes: Sequence[str | None] | None = None,
    gate: Callable[[int], Awaitable[bool]] | None = None,
    **kwargs: Any,
) -> AsyncIterator[tuple[int, TrajectoryResult | None]]:
    """Run `run_trajectory` for every env at once; yield (index, result) in finish order.

    `on_turn(i)` (optional) gives trajectory i's turn callback; `routes[i]` (optional) its
    route key; `gate(i)` (optional) is awaited before trajectory i starts, and False skips
    it (yielded with result None: dynamic sampling's reserves, rollout/oversample.py);
    other keyword arguments go to `run_trajectory` (or, with `tokenizer`, to `run_rendered`).
    A failing trajectory cancels the rest and re-raises.
    """
    if any(x is not None and len(x) != len(envs) for x in (env_seeds, routes)) or \
            len(seeds) != len(envs):
        raise ValueError("seeds/env_seeds/routes must have one entry per env")

    run = run_rendered if kwargs.get("tokenizer") is not None else run_trajectory

    async def one(i: int) -> tuple[int, TrajectoryResult | None]:
        if gate is not None and not await gate(i):
            return i, None
        res = await run(
            engine, envs[i], seed=seeds[i],
            env_seed=None if env_seeds is None else env_seeds[i],
            on_turn=None if on_turn is None else on_turn(i),
            route=None if routes is None else routes[i], **kwargs)
        return i, res

    async for done in as_finished([one(i) for i in range(len(envs))]):
        yield done


async def as_finished(coros: Sequence[Awaitable[T]]) -> AsyncIterator[T]:
    """Run `coros` at once and yield their results in finish order. A failure re-raises
    and cancels the rest; so does the caller leaving the iteration early."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        for fut in asyncio.as_completed(tasks):
            yield await fut
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        # Collect the rest so that no exception goes unretrieved (or lingers as a task).
        await asyncio.gather(*tasks, return_exceptions=True)
