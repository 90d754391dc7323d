"""A reasoning-gym scorer call in a jailed worker vs in the rollout process, side by side.

    python -m perf.studies.scorer_jail [--n 100] [--task spiral_matrix]

Both go through RewardRunner.score as the rollout calls it, on the same honest answer of
entry 0 of the task's set: "in-process" is `reward.isolation: none` (today's path: a
daemon thread per call); "jailed" is the default pool (rewards/jailed.py: a request to a
worker that forks a child per call). Calls alternate (in-process, jailed, ...) so a load
change on a shared machine hits both; the medians of `--n` calls each, plus the one-off
cost of starting the first worker. Run as root for the full jail (namespaces, cgroups,
seccomp).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from tsync_mcore.config import ReasoningGymConfig, RewardConfig
from tsync_mcore.data.rgym import task_sets
from tsync_mcore.rewards import RewardRunner
from tsync_mcore.rewards.jailed import task_scorer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--task", default="spiral_matrix")
    args = ap.parse_args()
    rc = ReasoningGymConfig(train_size=8)
    train, _ = task_sets(args.task, {}, train_seed=0, train_size=8, eval_seed=10**6,
                         eval_size=0)
    runners = {}
    t0 = time.perf_counter()
    for name, isolation in (("in-process", "none"), ("jailed", "isolate")):
        cfg = RewardConfig(isolation=isolation, workers=1)
        t = time.perf_counter()
        runners[name] = RewardRunner(task_scorer(args.task, rc, cfg, [train]),
                                     spec=f"reasoning_gym:{args.task} scorer",
                                     timeout_s=cfg.timeout_s)
        if name == "jailed":
            start_s = time.perf_counter() - t
    row = train.row(0)
    kw = dict(prompt=row.prompt, response=f"<answer>{row.label}</answer>", label=row.label,
              meta=row.meta)
    times: dict[str, list[float]] = {k: [] for k in runners}

    async def run() -> None:
        for _ in range(args.n):
            for name, runner in runners.items():
                t = time.perf_counter()
                res = await runner.score("perf", **kw)
                times[name].append(time.perf_counter() - t)
                assert res.reward == 1.0 and res.error is None, res

    asyncio.run(run())
    print(f"task {args.task}, {args.n} calls each, alternating "
          f"({time.perf_counter() - t0:.1f} s in all)")
    print("| path | median ms | p10 ms | p90 ms |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} | {q[0] * 1e3:.2f} | "
              f"{q[-1] * 1e3:.2f} |")
    print(f"first jailed worker's start (imports, dataset): {start_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
