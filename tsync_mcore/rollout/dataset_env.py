"""`rollout.env: dataset`: one dataset row, one model answer, scored by reward.function.

The prompt ids are rendered once per group (members share the row); `step` decodes the
answer (special tokens dropped) and awaits the reward call, whose own limit is
`reward.timeout_s` (the agent's step limit is set above it for this env). The runner is
reward.function's (RewardRunner) or the judge's (JudgeRunner): the same `score`.
"""

from __future__ import annotations

import copy
from typing import Any

from tsync_mcore.data import Row
from tsync_mcore.rewards import RewardResult, RewardRunner


class SingleTurnEnv:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], row: Row, runner: RewardRunner,
                 where: str, traj_id: str | None = None) -> None:
        self.tok, self.prompt_ids, self.row = tokenizer, list(prompt_ids), row
        self.runner, self.where, self.traj_id = runner, where, traj_id
        self.result: RewardResult | None = None
        self.response: str = ""

    def reset(self, seed: int) -> list[int]:
        # The row is the task; the seed (shared by the group) has nothing left to pick.
        self.result, self.response = None, ""
        return list(self.prompt_ids)

    async def step(self, action_ids: list[int]) -> tuple[list[int], bool]:
        self.response = self.tok.decode(action_ids, skip_special_tokens=True)
        # Each call gets its own copy of the row: a function that edits `meta` or `prompt`
        # cannot change what its group's other members see.
        row = self.row
        self.result = await self.runner.score(
            self.where, prompt=copy.deepcopy(row.prompt), response=self.response,
            label=copy.deepcopy(row.label), meta=copy.deepcopy(row.meta),
            traj_id=self.traj_id)
        return [], True

    def timeout_observation(self, action_ids: list[int]) -> tuple[list[int], bool]:
        # Only reached if the agent's limit fires before reward.timeout_s: scored 0.
        self.result = RewardResult(0.0, {}, f"reward function on {self.where}: the agent's "
                                            f"step limit passed first")
        return [], True

    def reward(self) -> float:
        return self.result.reward if self.result is not None else 0.0
