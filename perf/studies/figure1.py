"""The paper's Figure 1 in miniature, on a real task: the same training under several
schedules, rollout and learner on disjoint cores, and what each schedule bought.

Each schedule is one `launch/run.py` run, one after the other (perf/bench/schedule_runs.py),
from the same config, model, seed and number of updates, with `launch.rollout_cpus` and `launch.learner_cpus` set to
disjoint cores (the CPU analogue of rollout GPUs beside learner GPUs). When the task has an
evaluation set, every run evaluates θ_0 (`run.eval_first`) and θ_n (`run.eval_every` set to
the number of updates; `--set run.eval_every=K` for more), outside every step time. From
each run directory it reads, per update: the batch's reward, the step's wall time, the
rollout time, the learner tail (the metrics' close → optimizer step done, and the trace's
learner work after the last source arrived), the policy lag; per evaluation: pass@1.

Speedups are over sync, paired update by update (the same batches: the same data order and,
while θ agrees, the same samples), over the updates after `--warmup` (an asynchronous
schedule's after at least 2: its first two updates fill the pipeline, both on θ_0's
samples). The predicted speedup replays each run's trace through Eq. 14
(tsync_mcore.observability.predict), with the paired sync run's own trace as the
counterfactual, as the overlap benchmark (perf/bench/cell.py) does: thundersync lanes
served as sources arrived, one_step_off through `one_step_off_segment` with sync's suffix.
The replay keeps every source's measured service time and infers the optimizer step from
the step's own wall time, so measured over predicted shows the idle time a learner left
(dispatch, waiting), not a costlier service; `predicted_same_service` (Eq. 16 on the
schedule's own trace, the overlap benchmark's `speedup_same_service`) shows the latter.

Writes under --out: <schedule>/ (the run directories), logs/<schedule>.out (the launcher's
output), results.json, summary.md (the table printed at the end), reward_vs_update.png,
reward_vs_time.png and, when the runs evaluated, eval_accuracy.png. Then it prints one
`ok` / `FAIL` line per check: sync and thundersync trained the same policy (equal rewards;
the first update whose sampled tokens differ says where FP32 summation order made θ part),
thundersync's lag is 0 and one_step_off's 1, each measured speedup reached 95 % of its
prediction. A failed check does not change the exit code; bad input exits 2, a run that
failed exits 1.

    python -m perf.studies.figure1 --config CFG.yaml --model HF_DIR --updates 6 \\
        --out runs/figure1
    python -m perf.studies.figure1 --out runs/figure1 --report-only   # re-read the runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from statistics import mean

from tsync_mcore.observability import predict, trace
from tsync_mcore.observability.trace import Record

from perf.bench import schedule_runs

SCHEDULES = ("sync", "group_ready", "thundersync", "one_step_off", "fully_async")
ASYNC = ("one_step_off", "fully_async")
MIN_SHARE = 0.95  # measured speedup over predicted that the check asks for


# --------------------------------------------------------------------------------------------
# Reading a run directory
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one schedule's run directory holds."""

    schedule: str
    run_dir: str
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl, one per update
    evals: list[dict] = field(default_factory=list)  # eval.jsonl, one per evaluation
    records: dict[int, list[Record]] = field(default_factory=dict)  # trace, by update
    failed: str = ""  # why the run did not finish ("" if it did)


def read_run(schedule: str, run_dir: str) -> Run:
    """The run directory's trained updates (in step order), evaluations and traces."""
    base = schedule_runs.read_run(schedule, run_dir)
    rows = sorted((r for r in base.rows if r.get("ok", True)), key=lambda r: r["step"])
    return Run(schedule, run_dir, rows,
               schedule_runs.read_jsonl(os.path.join(run_dir, "eval.jsonl")),
               predict.load_traces(run_dir), base.failed)


# --------------------------------------------------------------------------------------------
# Per-update figures
# --------------------------------------------------------------------------------------------


def trace_tail(records: list[Record]) -> float | None:
    """Learner work after the update's last source arrived: the last service's end minus the
    last arrival (every rank; each rank's clock starts at the batch's registration)."""
    ready = [s.ready for s in trace.sources(records)]
    ends = [w.end for w in trace.work(records)]
    if not ready or not ends:
        return None
    return max(0.0, max(ends) - max(ready))


def updates(run: Run) -> list[dict]:
    """One row per trained update: step (1..n), reward, step/rollout/tail times, lag, the
    training clock at its end (sum of step times: start-up and evaluation not counted) and
    the pass@1 of θ_step when it was evaluated."""
    acc = {e["eval/policy_version"]: e.get("eval/pass@1") for e in run.evals}
    out, clock = [], 0.0
    for r in run.rows:
        clock += r["step_wall_time_s"]
        out.append(dict(
            step=r["step"], reward=r.get("reward_mean"), step_s=r["step_wall_time_s"],
            clock_s=clock, rollout_s=r.get("rollout_time_s"), tail_s=r.get("learner_tail_s"),
            trace_tail_s=trace_tail(run.records.get(r["policy_version"], [])),
            lag_mean=r.get("policy_lag_mean"), lag_max=r.get("policy_lag_max"),
            eval_pass1=acc.get(r["step"])))
    return out


def evaluations(run: Run) -> list[dict]:
    """(policy version, pass@1, mean reward) of every evaluation, in version order."""
    return sorted((dict(version=e["eval/policy_version"], pass1=e.get("eval/pass@1"),
                        reward=e.get("eval/reward_mean")) for e in run.evals),
                  key=lambda e: e["version"])


def digests(records: list[Record]) -> dict[str, str]:
    """Each source's tokens digest (trajectory id, turn → sha256) as the learner received it."""
    return {f"{s.traj_id}#{s.turn or 0}": s.tokens_sha256 for s in trace.sources(records)
            if s.tokens_sha256 is not None}


def first_token_divergence(a: Run, b: Run) -> int | None:
    """The first step (1..n) whose batch holds sources whose sampled tokens differ between
    the two runs; None if every common update agrees. Batch k is sampled with θ_{k−1}, so a
    difference there means the two θ_{k−1} differed."""
    for u in sorted(set(a.records) & set(b.records)):
        if digests(a.records[u]) != digests(b.records[u]):
            return u + 1
    return None


# --------------------------------------------------------------------------------------------
# Speedups: measured and trace-predicted, over the paired sync run
# --------------------------------------------------------------------------------------------


def skipped(schedule: str, warmup: int) -> int:
    """Updates left out of means: `warmup`, and an asynchronous schedule's pipeline fill."""
    return max(warmup, 2) if schedule in ASYNC else warmup


def steady_updates(sync: Run, run: Run, warmup: int) -> list[int]:
    """The policy versions both runs trained, past the skipped ones (all when none would be
    left)."""
    common = sorted({r["policy_version"] for r in sync.rows}
                    & {r["policy_version"] for r in run.rows})
    return common[skipped(run.schedule, warmup):] or common


def _predicted_step(run: Run, pred: dict[int, dict], ups: list[int], P_sync: float) -> float:
    """The schedule's predicted mean step over `ups`, from its own trace."""
    if run.schedule == "sync":
        return mean(pred[u]["T_sync"] for u in ups)
    if run.schedule == "thundersync":
        return mean(pred[u]["T_thundersync"] for u in ups)
    if run.schedule == "group_ready":
        from perf.bench.analysis import group_ready_step
        return mean(group_ready_step(run.records.get(u, []), pred[u]["R"], pred[u]["P"])
                    for u in ups)
    if run.schedule == "one_step_off":
        # the whole run is one segment from θ_0; the suffix is sync's (the same work)
        versions = sorted(pred)
        steps = predict.one_step_off_segment(
            [(pred[u]["R"], predict.jobs_by_rank(run.records.get(u, [])), P_sync)
             for u in versions])
        by_version = dict(zip(versions, steps))
        return mean(by_version[u] for u in ups)
    return mean(pred[u]["T_async"] for u in ups)  # fully_async: max(R, L + P), R per batch


def speedup(sync: Run, run: Run, warmup: int) -> dict:
    """Measured and predicted speedup of `run` over `sync` on their paired steady updates."""
    ups = steady_updates(sync, run, warmup)
    if not ups:
        return dict(updates=[], measured=None, predicted=None, measured_over_predicted=None)
    pred_sync = {u["update"]: u for u in predict.analyze_run(sync.run_dir, warmup=0)["updates"]}
    pred = {u["update"]: u for u in predict.analyze_run(run.run_dir, warmup=0)["updates"]}
    step = {r["policy_version"]: r["step_wall_time_s"] for r in run.rows}
    sync_step = {r["policy_version"]: r["step_wall_time_s"] for r in sync.rows}
    t_sync_pred = mean(pred_sync[u]["T_sync"] for u in ups)  # the counterfactual
    P_sync = mean(pred_sync[u]["P"] for u in ups)
    t_pred = _predicted_step(run, pred, ups, P_sync)
    measured = mean(sync_step[u] for u in ups) / mean(step[u] for u in ups)
    predicted = t_sync_pred / t_pred
    # Eq. 16 on the schedule's own trace: sync serving each source at the streamed cost
    # (what packing's cheaper service is worth shows as the gap to `predicted`)
    same = None if run.schedule in ASYNC else mean(pred[u]["T_sync"] for u in ups) / t_pred
    return dict(updates=[u + 1 for u in ups], step_s=mean(step[u] for u in ups),
                step_predicted_s=t_pred, measured=measured, predicted=predicted,
                measured_over_predicted=measured / predicted, predicted_same_service=same)


# --------------------------------------------------------------------------------------------
# The summary and its checks
# --------------------------------------------------------------------------------------------


def _avg(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(runs: dict[str, Run], warmup: int = 1) -> dict:
    """Everything results.json holds: per schedule its updates, evaluations and means over
    the steady updates, and its speedup over sync."""
    sync = runs.get("sync")
    out: dict = {"warmup": warmup, "schedules": {}}
    for s, run in runs.items():
        ups = updates(run)
        steady = ups[skipped(s, warmup):] or ups
        out["schedules"][s] = dict(
            run_dir=run.run_dir, failed=run.failed, updates=ups, evals=evaluations(run),
            step_s=_avg([u["step_s"] for u in steady]),
            rollout_s=_avg([u["rollout_s"] for u in steady]),
            tail_s=_avg([u["tail_s"] for u in steady]),
            trace_tail_s=_avg([u["trace_tail_s"] for u in steady]),
            lag_mean=_avg([u["lag_mean"] for u in ups]),
            lag_max=max((u["lag_max"] for u in ups if u["lag_max"] is not None), default=None),
            speedup=speedup(sync, run, warmup) if sync is not None and sync.rows and run.rows
            else None)
    if "sync" in runs and "thundersync" in runs:
        out["tokens_first_differ_at"] = first_token_divergence(runs["sync"], runs["thundersync"])
    return out


def checks(summary: dict) -> list[tuple[bool, str]]:
    """(passed, what) per check the summary allows."""
    S = summary["schedules"]
    out: list[tuple[bool, str]] = []
    for s, x in S.items():
        if x["failed"]:
            out.append((False, f"{s}: the run failed ({x['failed']}); its updates so far are "
                               f"reported"))
    if "sync" in S and "thundersync" in S:
        out.append(_same_policy(S["sync"]["updates"], S["thundersync"]["updates"],
                                summary.get("tokens_first_differ_at")))
    if "thundersync" in S or "one_step_off" in S:
        out.append(_lags(S.get("thundersync"), S.get("one_step_off")))
    for s, x in S.items():
        sp = x["speedup"]
        if s == "sync" or not sp or sp["measured"] is None:
            continue
        share = sp["measured_over_predicted"]
        out.append((share >= MIN_SHARE,
                    f"{s}: measured speedup {sp['measured']:.3f}x is {100 * share:.0f} % of the "
                    f"predicted {sp['predicted']:.3f}x (needs >= {100 * MIN_SHARE:.0f} %; "
                    f"updates {_span(sp['updates'])})"))
    return out


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0]) if steps else "none"


def _same_policy(sync: list[dict], ts: list[dict], differ_at: int | None) -> tuple[bool, str]:
    n = min(len(sync), len(ts))
    diff = [a["step"] for a, b in zip(sync, ts) if a["reward"] != b["reward"]]
    tokens = ("sampled tokens identical in every batch" if differ_at is None else
              f"sampled tokens first differ in the batch of update {differ_at} (θ_{differ_at - 1} "
              f"parted: FP32 summation order)")
    if diff:
        return False, (f"sync vs thundersync: reward differs from update {diff[0]} on "
                       f"({len(diff)} of {n} updates); {tokens}")
    return True, f"sync vs thundersync: equal reward in all {n} updates; {tokens}"


def _lags(ts: dict | None, osf: dict | None) -> tuple[bool, str]:
    """thundersync trains on-policy (lag 0); one_step_off's update k ≥ 2 on a batch sampled
    by θ_{k−2} (lag 1), its first on θ_0's (lag 0)."""
    ok, said = True, []
    if ts is not None:
        lags = [u["lag_max"] for u in ts["updates"]]
        good = all(x == 0 for x in lags)
        ok &= good
        said.append(f"thundersync lag {'0 in every update' if good else lags}")
    if osf is not None:
        lags = [u["lag_mean"] for u in osf["updates"]]
        good = all(x == (1.0 if i else 0.0) for i, x in enumerate(lags))
        ok &= good
        said.append(f"one_step_off lag {'1 from update 2 on' if good else lags}")
    return ok, "; ".join(said)


# --------------------------------------------------------------------------------------------
# Output: table, plots
# --------------------------------------------------------------------------------------------


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def markdown(summary: dict) -> str:
    """The summary table and the per-update table."""
    S = summary["schedules"]
    w = summary["warmup"]
    lines = ["| schedule | step s | rollout s | learner tail s (close → step) | trace tail s "
             "(after last arrival) | policy lag mean / max | reward first → last | eval "
             "pass@1 θ_0 → θ_n | speedup measured | predicted | measured / predicted | "
             "predicted, same service |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, x in S.items():
        ups, ev, sp = x["updates"], x["evals"], x["speedup"] or {}
        reward = f"{_f(ups[0]['reward'], '.3f')} → {_f(ups[-1]['reward'], '.3f')}" if ups else "-"
        acc = (f"{_f(ev[0]['pass1'], '.3f')} (θ_{ev[0]['version']}) → "
               f"{_f(ev[-1]['pass1'], '.3f')} (θ_{ev[-1]['version']})" if ev else "-")
        share = sp.get("measured_over_predicted")
        lines.append(
            f"| {s}{' (failed)' if x['failed'] else ''} | {_f(x['step_s'])} | {_f(x['rollout_s'])} "
            f"| {_f(x['tail_s'])} | {_f(x['trace_tail_s'])} | {_f(x['lag_mean'])} / "
            f"{_f(x['lag_max'], '')} | {reward} | {acc} | {_x(sp.get('measured'))} | "
            f"{_x(sp.get('predicted'))} | {_f(None if share is None else 100 * share, '.0f')} % "
            f"| {_x(sp.get('predicted_same_service'))} |")
    lines += ["", f"Means over updates after the first {w} ({', '.join(ASYNC)}: after "
                  f"{skipped(ASYNC[0], w)}, the pipeline's fill; speedups paired with sync's "
                  f"same updates); the learner tail from metrics.jsonl, the trace tail from "
                  f"traces/rank*.jsonl.", "",
              "| schedule | update | reward | step s | clock s | rollout s | tail s | trace tail s "
              "| lag | eval pass@1 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s, x in S.items():
        for u in x["updates"]:
            lines.append(f"| {s} | {u['step']} | {_f(u['reward'], '.3f')} | {_f(u['step_s'])} | "
                         f"{_f(u['clock_s'], '.1f')} | {_f(u['rollout_s'])} | {_f(u['tail_s'])} | "
                         f"{_f(u['trace_tail_s'])} | {_f(u['lag_mean'])} | "
                         f"{_f(u['eval_pass1'], '.3f')} |")
    return "\n".join(lines) + "\n"


def plots(summary: dict, out: str) -> list[str]:
    """reward_vs_update.png, reward_vs_time.png and (when evaluated) eval_accuracy.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    S = summary["schedules"]
    figs = [("reward_vs_update", "update", "step", "reward"),
            ("reward_vs_time", "training time (s, sum of step times)", "clock_s", "reward")]
    written = []
    for name, xlabel, x, y in figs:
        fig, ax = plt.subplots(figsize=(6, 4))
        for s, d in S.items():
            pts = [(u[x], u[y]) for u in d["updates"] if u[y] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("batch reward (mean)")
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        written.append(_save(fig, ax, os.path.join(out, f"{name}.png")))
    if any(d["evals"] for d in S.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for s, d in S.items():
            pts = [(e["version"], e["pass1"]) for e in d["evals"] if e["pass1"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_xlabel("policy version (updates trained)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("eval pass@1")
        written.append(_save(fig, ax, os.path.join(out, "eval_accuracy.png")))
    return written


def _save(fig, ax, path: str) -> str:
    import matplotlib.pyplot as plt
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(runs: dict[str, Run], out: str, warmup: int, meta: dict | None = None) -> bool:
    """results.json, summary.md and the plots under `out`; prints the table and the checks.
    Returns whether every check passed."""
    summary = summarize(runs, warmup)
    found = checks(summary)
    summary["checks"] = [dict(ok=ok, what=what) for ok, what in found]
    summary["meta"] = meta or {}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    table = markdown(summary)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(table)
    pngs = plots(summary, out)
    print("\n" + table, flush=True)
    for ok, what in found:
        print(f"{'ok' if ok else 'FAIL'} {what}", flush=True)
    print(f"results: {os.path.join(out, 'results.json')}; plots: {', '.join(pngs)}", flush=True)
    return all(ok for ok, _ in found)


# --------------------------------------------------------------------------------------------
# Running the schedules
# --------------------------------------------------------------------------------------------


class BadInput(Exception):
    """A one-line reason the command cannot run as asked (exit 2)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="the task's config (YAML, as launch/run.py takes it)")
    p.add_argument("--model", help="model.hf_dir (default: the config's)")
    p.add_argument("--updates", type=int, default=6, help="run.updates per schedule (default 6)")
    p.add_argument("--schedules", default="sync,thundersync,one_step_off",
                   help="comma list with sync, the baseline "
                        "(default sync,thundersync,one_step_off)")
    p.add_argument("--rollout-cpus", default="0", help="launch.rollout_cpus (default 0)")
    p.add_argument("--learner-cpus", default="1", help="launch.learner_cpus (default 1)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of every run (default: the config's)")
    p.add_argument("--warmup", type=int, default=1,
                   help="first updates left out of the means and speedups (default 1)")
    p.add_argument("--set", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more overrides for every run (after this script's own)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--report-only", action="store_true",
                   help="read the run directories already under --out, run nothing")
    args = p.parse_args(argv)
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.set = [kv for group in args.set for kv in group]
    return args


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be refused before a run starts."""
    bad = [s for s in args.schedules if s not in SCHEDULES]
    if bad or "sync" not in args.schedules or len(set(args.schedules)) != len(args.schedules):
        raise BadInput(f"--schedules: {', '.join(bad) or 'sync missing or a repeat'} (a comma "
                       f"list of {', '.join(SCHEDULES)}; sync is the baseline)")
    if args.updates < 1 or args.warmup < 0:
        raise BadInput("--updates must be >= 1 and --warmup >= 0")
    if args.report_only:
        missing = [s for s in args.schedules
                   if not os.path.exists(os.path.join(args.out, s, "metrics.jsonl"))]
        if missing:
            raise BadInput(f"--report-only: no {args.out}/<schedule>/metrics.jsonl for "
                           f"{', '.join(missing)}")
        return
    if not args.config or not os.path.isfile(args.config):
        raise BadInput(f"--config: {args.config or '(not given)'} is not a file")
    from tsync_mcore.util import cpus
    rollout, learner = cpus.parse(args.rollout_cpus), cpus.parse(args.learner_cpus)
    if not rollout or not learner:
        raise BadInput("--rollout-cpus / --learner-cpus: CPU lists like '0' or '2-3'")
    if set(rollout) & set(learner):
        raise BadInput(f"--rollout-cpus {args.rollout_cpus} and --learner-cpus "
                       f"{args.learner_cpus} share cores: give each side its own")
    here = os.sched_getaffinity(0)
    if not set(rollout + learner) <= here:
        raise BadInput(f"cores {sorted(set(rollout + learner) - here)} are not available here "
                       f"(this process may use {sorted(here)})")
    for s in args.schedules:  # every run's config, as launch/run.py will load it
        cfg = load(args, s)
        if not os.path.isfile(os.path.join(cfg.model.hf_dir, "config.json")):
            raise BadInput(f"model.hf_dir {cfg.model.hf_dir}: no config.json (pass --model)")


def overrides(args: argparse.Namespace, schedule: str, evaluate: bool = True) -> list[str]:
    """The run's --set list: this script's keys, then the user's."""
    from tsync_mcore.util.net import free_port
    sets = [f"run.dir={os.path.join(os.path.abspath(args.out), schedule)}",
            f"learner.schedule={schedule}", f"run.updates={args.updates}",
            f"launch.rollout_cpus={args.rollout_cpus}", f"launch.learner_cpus={args.learner_cpus}",
            f"channel.port={free_port()}", "run.save_every=0", "run.export_hf=false"]
    if args.model:
        sets.append(f"model.hf_dir={os.path.abspath(args.model)}")
    if args.seed is not None:
        sets.append(f"seed={args.seed}")
    if evaluate and schedule != "fully_async":  # fully_async has no "between batches"
        sets += ["run.eval_first=true", f"run.eval_every={args.updates}"]
    return sets + args.set


def load(args: argparse.Namespace, schedule: str):
    """The run's validated config; a task without an evaluation set runs without one."""
    from tsync_mcore.config import ConfigError, load_config, parse_overrides
    try:
        base = load_config(args.config, parse_overrides(overrides(args, schedule, False)))
        evaluate = base.rollout.env not in ("toy", "terminal") and bool(
            base.data.eval or base.reasoning_gym.eval_size)
        return load_config(args.config, parse_overrides(overrides(args, schedule, evaluate)))
    except ConfigError as e:
        raise BadInput(f"{schedule}: {e}") from None


def train(args: argparse.Namespace, schedule: str) -> str:
    """One run of `schedule` through launch/run.py; '' on success, else why it failed."""
    cfg = load(args, schedule)
    sets = overrides(args, schedule, evaluate=bool(cfg.run.evaluating))
    print(f"== {schedule}: {args.updates} updates, rollout on cores {args.rollout_cpus}, "
          f"learner on {args.learner_cpus}; {cfg.run.dir}", flush=True)
    t0 = time.time()
    run = schedule_runs.launch(schedule, args.config, sets, cfg.run.dir, echo="   ",
                               log=os.path.join(args.out, "logs", f"{schedule}.out"))
    print(f"== {schedule}: {run.failed or 'done'} in {time.time() - t0:.0f} s", flush=True)
    return run.failed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
    except BadInput as e:
        print(f"error: figure1: {e}", file=sys.stderr)
        return 2
    failed = False
    for s in args.schedules if not args.report_only else []:
        failed |= bool(train(args, s))
    meta = dict(config=args.config, model=args.model, updates=args.updates, seed=args.seed,
                rollout_cpus=args.rollout_cpus, learner_cpus=args.learner_cpus, sets=args.set)
    try:
        runs = {s: read_run(s, os.path.join(args.out, s)) for s in args.schedules}
        report(runs, args.out, args.warmup, meta)
    except (OSError, ValueError) as e:  # a damaged run directory (TraceError is a ValueError)
        print(f"error: figure1: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
