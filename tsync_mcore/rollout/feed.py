"""The rollout's dataset side: which row each group trains on, the envs that run a row,
the rollout-side reward metrics of a batch, and evaluation on data.eval. A reasoning-gym
task (rollout.env: reasoning_gym:<task>) is fed the same way, its sets generated at start,
and so is a verifiers environment's dataset (rollout.env: verifiers:<module>; its agents
run and score each row: tsync_mcore.rollout.vf_env).

Group g of the batch registered at data position p trains on row
`EpochSampler.index(p + g)` (tsync_mcore.data.sampler), so the checkpointed data_pos
fixes the prompts of a resumed run.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from tsync_mcore.config import Config, ReasoningGymConfig
from tsync_mcore.data import DataError, EpochSampler, PromptSet, Row, load_prompts, render_prompt
from tsync_mcore.data.rgym import TaskSet, task_sets
from tsync_mcore.rewards import RewardRunner, RewardStats
from tsync_mcore.rewards.call import eval_metrics
from tsync_mcore.rewards.jailed import reward_scorer, task_scorer
from tsync_mcore.rewards.judge import JudgeRunner, JudgeStats
from tsync_mcore.rollout.loop import run_batch
from tsync_mcore.rollout.dataset_env import SingleTurnEnv
from tsync_mcore.rollout.envs import SkyRLGymAdapter
from tsync_mcore.rollout.vf_env import VerifiersSet, VerifiersTask, load_env


def _seed(*parts: Any) -> int:
    """A sampling seed from its parts, stable across processes (str hash is salted)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


class BatchStats(RewardStats):
    """RewardStats fed with finished envs (dataset envs carry their RewardResult)."""

    def add(self, env: Any) -> None:  # type: ignore[override]
        result = getattr(env, "result", None)
        if result is not None:
            super().add(result)


class DataFeed:
    def __init__(self, cfg: Config) -> None:
        self.cfg, self.dc = cfg, cfg.data
        env = cfg.rollout.env
        self.skyrl = env.split(":", 1)[1] if env.startswith("skyrl:") else None
        self.rgym = env.split(":", 1)[1] if env.startswith("reasoning_gym:") else None
        self.vf = env.split(":", 1)[1] if env.startswith("verifiers:") else None
        self.train: PromptSet | TaskSet | VerifiersSet
        self.eval: PromptSet | TaskSet | VerifiersSet | None
        self.runner: RewardRunner | JudgeRunner | None = None
        if self.rgym is not None:
            self._generate(cfg.reasoning_gym)
        elif self.vf is not None:
            self._verifiers()
        else:
            self._load()
        self.sampler = EpochSampler(len(self.train), cfg.seed, self.dc.shuffle)
        self.tok = None

    def _load(self) -> None:
        """data.train / data.eval, and reward.function unless a SkyRL env scores."""
        cfg = self.cfg
        # SkyRL rows carry their ground truth in reward_spec; a label column is optional.
        self.train = load_prompts(self.dc.train, self.dc, require_label=self.skyrl is None)
        self.eval = (load_prompts(self.dc.eval, self.dc, require_label=self.skyrl is None)
                     if self.dc.eval else None)
        if self.skyrl is not None:
            import skyrl_gym  # noqa: F401  (a missing package is named at start)
            for ps in filter(None, (self.train, self.eval)):
                if "env_class" in ps.ds.column_names:
                    other = sorted(set(map(str, ps.ds.unique("env_class"))) - {self.skyrl})
                    if other:
                        raise DataError(f"{ps.path}: rows for env_class {other}; this run's "
                                        f"rollout.env is skyrl:{self.skyrl}")
            return
        if cfg.reward.function == "judge":  # its engine is attached by the driver
            self.runner = JudgeRunner(cfg.reward.judge, timeout_s=cfg.reward.timeout_s,
                                      on_error=cfg.reward.on_error, seed=cfg.seed,
                                      records_dir=os.path.join(cfg.run.dir, "judge"),
                                      policy_tokens=cfg.rollout.max_total_tokens)
            return
        fn = reward_scorer(cfg.reward.function, cfg.reward)  # jailed unless in-process
        self.runner = RewardRunner(fn, spec=cfg.reward.function, timeout_s=cfg.reward.timeout_s,
                                   on_error=cfg.reward.on_error)

    def _generate(self, rc: ReasoningGymConfig) -> None:
        """rollout.env: reasoning_gym:<task>: both sets generated now, scored by the task."""
        self.train, self.eval = task_sets(self.rgym, rc.params, train_seed=rc.train_seed,
                                          train_size=rc.train_size, eval_seed=rc.eval_seed,
                                          eval_size=rc.eval_size)
        if self.eval is not None and self.eval.left_out:
            print(f"[rollout] reasoning_gym: {self.eval.left_out} of {rc.eval_size} evaluation "
                  f"questions are also in the training set and were left out", flush=True)
        scorer = task_scorer(self.rgym, rc, self.cfg.reward,
                             [ts for ts in (self.train, self.eval) if ts is not None])
        self.runner = RewardRunner(scorer, spec=f"reasoning_gym:{self.rgym} scorer",
                                   timeout_s=self.cfg.reward.timeout_s,
                                   on_error=self.cfg.reward.on_error)

    def _verifiers(self) -> None:
        """rollout.env: verifiers:<module>: the environment, loaded once here for its
        datasets (each agent loads it again to run and score its rows)."""
        env = load_env(self.vf, self.cfg.verifiers.args)
        self.train = VerifiersSet(self.vf, env, "train")
        ev = VerifiersSet(self.vf, env, "eval")
        self.eval = ev if ev.ds is not None else None
        evaluating = self.cfg.run.evaluating
        if evaluating and self.eval is None:
            raise DataError(f"{evaluating.split('=')[0]}: verifiers:{self.vf} has no eval_dataset "
                            f"to evaluate on (set run.eval_every 0)")

    def attach(self, tokenizer: Any) -> None:
        """The tokenizer prompts are rendered with. Every row of each set is rendered now:
        a missing chat template, or a prompt that leaves no room for an answer within
        rollout.max_total_tokens, stops the run before the first batch (naming the row),
        not when the sampler reaches it hours later."""
        self.tok = tokenizer
        for ps in filter(None, (self.train, self.eval)):
            for i in range(len(ps)):
                self._ids(ps, ps.row(i))

    def train_row(self, pos: int) -> int:
        return self.sampler.index(pos)

    def stats(self) -> BatchStats:
        return BatchStats()

    def _ids(self, ps: PromptSet | TaskSet, row: Row) -> list[int]:
        try:
            ids = render_prompt(self.tok, row, self.dc.system_prompt, self.dc.chat_template)
        except DataError as e:
            raise DataError(f"{ps.path} {e}") from None
        limit = self.cfg.rollout.max_total_tokens
        if len(ids) >= limit:
            raise DataError(f"{ps.path} row {row.index}: prompt of {len(ids)} tokens leaves no "
                            f"room for an answer within rollout.max_total_tokens={limit}")
        return ids

    def _env(self, ps: PromptSet | TaskSet, index: int, where: str,
             traj_id: str | None = None) -> Any:
        row = ps.row(index)
        if self.skyrl is not None:
            self._ids(ps, row)  # the same length check as for dataset prompts
            return SkyRLGymAdapter.from_row(self.skyrl, self.tok, row,
                                            system_prompt=self.dc.system_prompt,
                                            max_turns=self.cfg.rollout.max_turns)
        if self.vf is not None:
            self._ids(ps, row)  # the same length check as for dataset prompts
            return VerifiersTask(self.vf, row, f"{where} ({ps.path} row {index})",
                                 self.cfg.reward.on_error)
        return SingleTurnEnv(self.tok, self._ids(ps, row), row, self.runner,
                             f"{where} ({ps.path} row {index})", traj_id=traj_id)

    def train_envs(self, rows: list[int], traj_ids: list[str]) -> list[Any]:
        return [self._env(self.train, r, f"trajectory {t}", t)
                for r, t in zip(rows, traj_ids)]

    @property
    def judge(self) -> JudgeRunner | None:
        """reward.function 'judge': its runner (the driver attaches the engine)."""
        return self.runner if isinstance(self.runner, JudgeRunner) else None

    async def evaluate(self, engine: Any, version: int, agents: Any = None
                       ) -> dict[str, float]:
        """Every eval row (or the first data.eval_max_prompts) × data.eval_n samples with θ
        as loaded in `engine`: eval/reward_mean, eval/pass@k, eval/reward_errors.
        `agents(envs, seeds, rows, traj_ids, routes, kwargs)`: who runs them instead of the
        built-in loop (rollout.agent: openai: the training batches' agents)."""
        assert self.eval is not None
        rc, n = self.cfg.rollout, self.dc.eval_n
        m = min(len(self.eval), self.dc.eval_max_prompts or len(self.eval))
        index = [(r, j) for r in range(m) for j in range(n)]
        ids = [f"eval{version}-r{r}-s{j}" for r, j in index]
        envs = [self._env(self.eval, r, f"eval sample {j} of θ_{version}", t)
                for (r, j), t in zip(index, ids)]
        judge = self.judge
        if judge is not None:  # counted apart: the batch's judge figures stay the batch's
            batch_stats, judge.stats = judge.stats, JudgeStats()
        seeds = [_seed(self.cfg.seed, "eval", version, r, j) for r, j in index]
        rewards: list[list[float]] = [[] for _ in range(m)]
        stats = BatchStats()
        rows = [r for r, _ in index]
        routes = [f"eval{version}-row{r}" for r in rows]  # a row: one replica
        kwargs = dict(max_turns=rc.max_turns, max_tokens_per_turn=rc.max_tokens_per_turn,
                      max_total_tokens=rc.max_total_tokens, temperature=rc.eval_temperature,
                      step_timeout_s=(self.cfg.reward.timeout_s + 5.0 if self.skyrl is None
                                      else rc.tool_timeout_s * 2))
        runs = (agents(envs, seeds, rows, ids, routes, kwargs) if agents is not None else
                run_batch(engine, envs, seeds=seeds, env_seeds=rows, routes=routes, **kwargs))
        async for i, res in runs:
            rewards[index[i][0]].append(res.reward)
            stats.add(envs[i])
        out = eval_metrics(rewards, n)
        out["eval/reward_errors"] = stats.errors
        out.update({k.replace("reward/", "eval/reward_", 1): v
                    for k, v in stats.metrics().items() if k != "reward/errors"})
        if judge is not None:  # eval/reward_judge_*, and the batch's counters back
            out.update(judge.take_metrics("eval/reward_"))
            judge.stats = batch_stats
        return out
