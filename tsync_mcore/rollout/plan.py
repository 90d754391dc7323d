"""What a batch is before it runs: its groups and trajectories (ids, sampling seeds, task
seeds, data rows), their environments, and the agent loop's budgets for them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tsync_mcore.config import Config
from tsync_mcore.rollout.envs import SkyRLGymAdapter, ToyToolConfig, ToyToolEnv
from tsync_mcore.rollout.feed import DataFeed


@dataclass
class Batch:
    """The trajectories of update `version`, in launch order, and their groups."""
    version: int
    groups: dict[str, list[str]]
    env_seeds: list[int]
    seeds: list[int]
    traj_ids: list[str]
    group_of: list[str]
    rows: list[int] | None = None  # dataset envs: each trajectory's row (its group's)


def plan_batch(cfg: Config, feed: DataFeed | None, version: int, data_pos: int) -> Batch:
    """Update `version`'s groups, from data position `data_pos` on; with dynamic sampling,
    its reserve groups after the batch's own (rollout/oversample.py)."""
    rc = cfg.rollout
    groups, env_seeds, seeds, traj_ids, group_of = {}, [], [], [], []
    rows = [] if feed is not None else None
    for g in range(rc.groups_per_batch + rc.max_oversample):
        gid = f"v{version}-g{g}"
        members = [f"{gid}-t{i}" for i in range(rc.group_size)]
        groups[gid] = members
        for i, tid in enumerate(members):
            env_seeds.append(data_pos + g)  # members share the task (prompt)
            seeds.append(hash((cfg.seed, version, g, i)) & 0x7FFFFFFF)
            traj_ids.append(tid)
            group_of.append(gid)
            if rows is not None:  # data position data_pos + g: the group's row
                rows.append(feed.train_row(data_pos + g))
    return Batch(version, groups, env_seeds, seeds, traj_ids, group_of, rows)


def plan_group(cfg: Config, feed: DataFeed | None, pos: int) -> Batch:
    """fully_async: the one group at data position `pos`, as a batch of its own (its
    update is decided once it completed)."""
    gid, m = f"d{pos}", cfg.rollout.group_size
    tids = [f"{gid}-t{i}" for i in range(m)]
    seeds = [hash((cfg.seed, pos, i)) & 0x7FFFFFFF for i in range(m)]
    rows = [feed.train_row(pos)] * m if feed is not None else None
    return Batch(0, {gid: tids}, [pos] * m, seeds, tids, [gid] * m, rows)


def n_turns(cfg: Config, batch: Batch, turns: bool) -> dict[str, int]:
    """RegisterBatch.n_turns: OPD (`turns`) registers turn counts up front; the toy task
    always runs max_turns turns."""
    return {t: cfg.rollout.max_turns for t in batch.traj_ids} if turns else {}


def batch_envs(cfg: Config, tok: Any, feed: DataFeed | None, batch: Batch,
               salt: int | None = None) -> list:
    """The batch's environments; `salt` (fully_async: the group's data position) varies
    the toy tool's latencies from group to group."""
    rc = cfg.rollout
    n = len(batch.traj_ids)
    if feed is not None:
        return feed.train_envs(batch.rows, batch.traj_ids)
    if rc.env == "toy":
        conf = ToyToolConfig(max_turns=rc.max_turns, latency_median_s=rc.tool_latency_s,
                             tool_timeout_s=rc.tool_timeout_s)
        rng = (lambda i: random.Random(i)) if salt is None else \
            (lambda i: random.Random(salt * 1_000_003 + i))
        return [ToyToolEnv(tok, conf, latency_rng=rng(i)) for i in range(n)]
    if rc.env == "terminal":
        from tsync_mcore.rollout.terminal_env import terminal_envs
        return terminal_envs(tok, n, max_turns=rc.max_turns, tools_cfg=cfg.tools)
    name = rc.env.split(":", 1)[1]
    prompt = [{"role": "user", "content": "Solve the task step by step."}]
    return [SkyRLGymAdapter.from_registry(name, tok, prompt) for _ in range(n)]


def step_timeout_s(cfg: Config) -> float:
    """The agent loop's guard on one env step."""
    rc = cfg.rollout
    # The dataset env's step is the reward call, limited by reward.timeout_s itself.
    if rc.env == "dataset" or rc.env.startswith("reasoning_gym:"):
        return cfg.reward.timeout_s + 5.0
    if rc.env == "terminal":  # a turn's tool calls, then (last turn) the verifier
        t = cfg.tools
        return t.timeout_s * t.max_calls_per_turn + t.verify_timeout_s + 10.0
    return rc.tool_timeout_s * 2


def loop_kwargs(cfg: Config, tok: Any) -> dict[str, Any]:
    """The agent loop's budgets and sampling (loop.run_batch's keywords); rollout.render:
    template renders each turn with the chat template (loop.run_rendered)."""
    rc = cfg.rollout
    kwargs = dict(max_turns=rc.max_turns, max_tokens_per_turn=rc.max_tokens_per_turn,
                  max_total_tokens=rc.max_total_tokens, temperature=rc.temperature,
                  step_timeout_s=step_timeout_s(cfg))
    if rc.render == "template":
        kwargs.update(tokenizer=tok, template_kwargs=dict(rc.chat_template_kwargs))
    return kwargs
