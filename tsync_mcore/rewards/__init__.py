"""Rewards: the user's function (load), how it is called and its result checked (call),
scorers that read model output run in a pool of jailed workers (jailed; the worker's loop:
worker; their frames: wire), the built-ins (builtins) and the code sandbox they use
(sandbox), a judge model's grades (judge). docs/guide/data-and-rewards.md."""

from tsync_mcore.rewards.call import (RewardFailed, RewardResult, RewardRunner, RewardStats,
                                      pass_at_k)
from tsync_mcore.rewards.load import RewardError, load_reward_fn

__all__ = ["RewardError", "RewardFailed", "RewardResult", "RewardRunner", "RewardStats",
           "load_reward_fn", "pass_at_k"]
