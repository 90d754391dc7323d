"""Environments for multi-turn rollouts, in token ids.

Protocol: `reset(seed)` gives the prompt ids (chat template applied, ending at the
assistant header), `await step(action_ids)` runs the tool on one model turn and gives the
observation ids and `done`, `reward()` the trajectory's reward once done.

Observation ids close the assistant turn and open the next one: `<|im_end|>` (only when
the action did not already end with it), then the tool/user messages, then the next
assistant header. They are never empty when not done, so each later turn starts with
unscored tokens, as the learner requires.

`ToyToolEnv` is a built-in verifiable task with a long-tailed tool latency;
`SkyRLGymAdapter` wraps a text-in/text-out `skyrl_gym` environment.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class AgentEnv(Protocol):
    def reset(self, seed: int) -> list[int]:
        """Start an episode; return the prompt token ids."""
        ...

    async def step(self, action_ids: list[int]) -> tuple[list[int], bool]:
        """Run the tool on one model turn; return (observation ids, done)."""
        ...

    def timeout_observation(self, action_ids: list[int]) -> tuple[list[int], bool]:
        """What the agent appends when `step` exceeds the agent's own time limit."""
        ...

    def reward(self) -> float:
        """The trajectory's reward; valid once done (or when the agent stops early)."""
        ...


def observation_ids(tokenizer: Any, messages: Sequence[dict[str, str]],
                    action_ids: Sequence[int]) -> list[int]:
    """Token ids that end the assistant turn, add `messages`, and open the next turn."""
    eos = tokenizer.eos_token_id
    close = [] if action_ids and action_ids[-1] == eos else [eos]
    # The chat template renders messages as "<|im_start|>role\n...<|im_end|>\n"; the
    # newline after the assistant's "<|im_end|>" belongs here.
    text = "\n" + tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                tokenize=False)
    return close + list(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def token_class(tokenizer: Any, chars: str = "0123456789") -> frozenset[int]:
    """Ids whose text (whitespace stripped) is non-empty and made only of `chars`."""
    out = set()
    special = set(tokenizer.all_special_ids)
    for i in range(len(tokenizer)):
        if i in special:
            continue
        s = tokenizer.decode([i]).strip()
        if s and all(c in chars for c in s):
            out.add(i)
    return frozenset(out)


@dataclass(frozen=True)
class ToyToolConfig:
    max_turns: int = 3
    latency_median_s: float = 0.05  # median simulated tool latency
    latency_sigma: float = 1.0  # log-normal shape: a long tail of slow calls
    tool_timeout_s: float = 0.5  # a call slower than this returns "timeout"
    target_chars: str = "0123456789"


class ToyToolEnv:
    """Write target-class tokens (digits); a counting tool reports progress after each turn.

    Reward: the fraction of all action tokens (the closing `<|im_end|>` included) in the
    target class, in [0, 1]. A random tiny model starts near |class|/|vocab| (~3 % for
    digits in a 300-token vocabulary), and GRPO only has to raise the logits of one token
    class, which a few updates of lm_head/bias do. The tool is simulated: it sleeps a
    log-normal time and answers with the running count, or "timeout" past
    `tool_timeout_s` (the action still counts toward the reward).
    """

    def __init__(self, tokenizer: Any, config: ToyToolConfig | None = None, *,
                 latency_rng: random.Random | None = None,
                 target_ids: frozenset[int] | None = None) -> None:
        self.tok = tokenizer
        self.cfg = config or ToyToolConfig()
        self.target_ids = target_ids if target_ids is not None else token_class(
            tokenizer, self.cfg.target_chars)
        if not self.target_ids:
            raise ValueError(f"ToyToolEnv: no token of the tokenizer is made of "
                             f"{self.cfg.target_chars!r}")
        # Latency randomness is separate from the task seed: members of a group share the
        # prompt but not their tool delays.
        self._lat_rng = latency_rng or random.Random()
        self._n_action = 0
        self._n_target = 0
        self.turn = 0
        self.n_timeouts = 0
        self.tool_latencies: list[float] = []

    def reset(self, seed: int) -> list[int]:
        self._n_action = self._n_target = self.turn = self.n_timeouts = 0
        self.tool_latencies = []
        return prompt_ids(self.tok, self.task_messages(seed))

    @staticmethod
    def task_messages(seed: int) -> list[dict[str, str]]:
        """The task's chat messages for `seed` (what an external agent is given)."""
        task = random.Random(seed).randint(0, 999)
        return [{"role": "user", "content": f"Task {task}: write digits only. A counter "
                                            f"tool reports your digit count."}]

    @staticmethod
    def tool_text(n_target: int, n_action: int) -> str:
        """The counter tool's answer after `n_action` action tokens, `n_target` of them
        in the target class."""
        return f"{n_target}/{n_action} digits"

    def account(self, action_ids: Sequence[int]) -> None:
        """Count one action toward the reward (its target-class tokens), and the turn."""
        self._n_action += len(action_ids)
        self._n_target += sum(1 for t in action_ids if t in self.target_ids)
        self.turn += 1

    async def _tool(self, latency: float) -> str:
        await asyncio.sleep(latency)
        return self.tool_text(self._n_target, self._n_action)

    async def step_messages(self, action_ids: list[int]) -> tuple[list[dict[str, str]], bool]:
        """The tool's answer to one model turn as chat messages (the loop that renders
        every turn with the chat template, rollout.render: template), and `done`."""
        self.account(action_ids)
        if self.turn >= self.cfg.max_turns:
            return [], True  # the last turn is the answer: no tool call behind it
        latency = self._lat_rng.lognormvariate(math.log(self.cfg.latency_median_s),
                                               self.cfg.latency_sigma)
        self.tool_latencies.append(latency)
        try:
            text = await asyncio.wait_for(self._tool(latency), self.cfg.tool_timeout_s)
        except asyncio.TimeoutError:
            self.n_timeouts += 1
            text = "timeout"
        return [{"role": "tool", "content": text}], False

    async def step(self, action_ids: list[int]) -> tuple[list[int], bool]:
        msgs, done = await self.step_messages(action_ids)
        return (observation_ids(self.tok, msgs, action_ids) if msgs else []), done

    def timeout_messages(self, action_ids: list[int]) -> tuple[list[dict[str, str]], bool]:
        # `step` already accounted the action before the agent gave up on it.
        if self.turn >= self.cfg.max_turns:
            return [], True
        return [{"role": "tool", "content": "timeout"}], False

    def timeout_observation(self, action_ids: list[int]) -> tuple[list[int], bool]:
        msgs, done = self.timeout_messages(action_ids)
        return (observation_ids(self.tok, msgs, action_ids) if msgs else []), done

    def reward(self) -> float:
        return self._n_target / self._n_action if self._n_action else 0.0


class SkyRLGymAdapter:
    """A `skyrl_gym` text environment (`BaseTextEnv`) as an `AgentEnv`.

    `make_env()` builds a fresh skyrl env per episode (they are single-use). Actions are
    decoded without special tokens and passed to the env's synchronous `step` in a worker
    thread (tools may block); its observation messages are rendered with the chat
    template. `reward_mode`: "last" (the final step's reward, SkyRL's outcome reward) or
    "sum" (per-turn rewards added).
    """

    def __init__(self, make_env: Callable[[], Any], tokenizer: Any,
                 prompt: Sequence[dict[str, str]], *,
                 reward_mode: str = "last") -> None:
        if reward_mode not in ("last", "sum"):
            raise ValueError(f"reward_mode must be 'last' or 'sum', got {reward_mode!r}")
        self.make_env = make_env
        self.tok = tokenizer
        self.prompt = list(prompt)
        self.reward_mode = reward_mode
        self.env: Any = None
        self.rewards: list[float] = []
        self.metadata: list[dict] = []

    @classmethod
    def from_registry(cls, env_id: str, tokenizer: Any, prompt: Sequence[dict[str, str]], *,
                      reward_mode: str = "last", **make_kwargs: Any) -> "SkyRLGymAdapter":
        import skyrl_gym

        return cls(lambda: skyrl_gym.make(env_id, **make_kwargs), tokenizer, prompt,
                   reward_mode=reward_mode)

    @classmethod
    def from_row(cls, env_id: str, tokenizer: Any, row: Any, *, system_prompt: str = "",
                 max_turns: int = 1, reward_mode: str = "last") -> "SkyRLGymAdapter":
        """An env for one dataset row laid out as SkyRL's datasets are: the prompt (chat
        messages), and every other column (`reward_spec`, `extra_info`, ...) as the env's
        `extras`, with `max_turns` as SkyRL's generator sets it. A row without
        `reward_spec` but with a label gets `{"method": "rule", "ground_truth": label}`."""
        import skyrl_gym

        from tsync_mcore.data import row_messages

        extras = dict(row.meta)
        if "reward_spec" not in extras and row.label is not None:
            extras["reward_spec"] = {"method": "rule", "ground_truth": row.label}
        extras["max_turns"] = max_turns
        return cls(lambda: skyrl_gym.make(env_id, extras=extras), tokenizer,
                   row_messages(row, system_prompt), reward_mode=reward_mode)

    def reset(self, seed: int) -> list[int]:
        # skyrl_gym envs take no seed: Python's `random` is seeded with it while the env is
        # built and initialised (synchronously, so no other episode interleaves), then
        # restored. Steps run in worker threads and are not seeded.
        if self.env is not None:
            self.env.close()
        state = random.getstate()
        random.seed(seed)
        try:
            self.env = self.make_env()
            self.rewards, self.metadata = [], []
            conversation, _info = self.env.init(self.prompt)
        finally:
            random.setstate(state)
        return prompt_ids(self.tok, conversation)

    async def step(self, action_ids: list[int]) -> tuple[list[int], bool]:
        if self.env is None:
            raise RuntimeError("SkyRLGymAdapter.step before reset")
        text = self.tok.decode(action_ids, skip_special_tokens=True)
        out = await asyncio.to_thread(self.env.step, text)
        self.rewards.append(float(out["reward"]))
        self.metadata.append(dict(out.get("metadata") or {}))
        if out["done"]:
            return [], True
        return observation_ids(self.tok, out["observations"], action_ids), False

    def timeout_observation(self, action_ids: list[int]) -> tuple[list[int], bool]:
        # The env's state after an abandoned step is unknown: end the episode.
        return [], True

    def reward(self) -> float:
        if not self.rewards:
            return 0.0
        return self.rewards[-1] if self.reward_mode == "last" else sum(self.rewards)
