"""Plots and a Markdown summary of one run, or several side by side.

    python -m tsync_mcore.observability.report RUN_DIR [--compare OTHER_RUN_DIR ...] [--out DIR] [--warmup N]

Reads only what the learner writes (RUN_DIR/metrics.jsonl, RUN_DIR/traces/rank*.jsonl) and
writes into --out (default RUN_DIR/report): step_breakdown.png (step wall time split into
rollout, residual learner tail and publication, per run — the paper's Figure 4),
release_trace.png (ready vs service of every source of each run's last update),
utilization.png (learner busy fraction over time against the rollout window, per run —
Figure 3), mfu.png, memory.png, reward.png and summary.md (the table to paste into a
discussion). Runs whose mean rollout times differ by more than 10 % are not compared by step
time: the summary says so, with both rollout times, and compares step − R and the learner
tail instead.
"""

from __future__ import annotations

import argparse
import json
import os
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tsync_mcore.observability import trace  # noqa: E402
from tsync_mcore.observability.trace import DeferredRecord, TraceError  # noqa: E402


# Runs whose mean rollout time R is within this fraction of the reference run's compare by
# step time; beyond it a step-time "speedup" mostly measures the rollout, so the report
# compares what the learner side adds instead (step − R, learner tail) and says so.
COMPARABLE_ROLLOUT = 0.10


class ReportError(ValueError):
    """A run directory the report cannot read; the message names it."""


def load_run(run_dir: str) -> dict:
    if not os.path.isdir(run_dir):
        raise ReportError(f"run directory {run_dir} does not exist")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ReportError(f"{path} not found (not a run directory?)")
    metrics = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReportError(f"{path}:{lineno}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ReportError(f"{path}:{lineno}: a metrics row must be a JSON object")
            if row.get("ok", True):  # a skipped batch (non-finite gradient) has no times
                metrics.append(row)
    if not metrics:
        raise ReportError(f"{path}: no completed updates")
    traces = trace.read_run(run_dir)
    name = os.path.basename(os.path.normpath(run_dir))
    label = f"{name} ({metrics[0].get('schedule')})"
    return {"dir": run_dir, "label": label, "metrics": metrics, "traces": traces}


def steady(rows: list[dict], warmup: int) -> list[dict]:
    return rows[warmup:] if len(rows) > warmup else rows


def summarize(run: dict, warmup: int) -> dict:
    rows = steady(run["metrics"], warmup)
    pick = lambda k: [r[k] for r in rows if r.get(k) is not None]  # noqa: E731
    mfu = pick("mfu_active")
    rewards = pick("reward_mean")
    exposed = [r["step_wall_time_s"] - r["rollout_time_s"] for r in rows
               if r.get("step_wall_time_s") is not None and r.get("rollout_time_s") is not None]
    return {
        "run": run["label"], "updates": len(run["metrics"]),
        "step_s": mean(pick("step_wall_time_s")), "rollout_s": mean(pick("rollout_time_s")),
        "tail_s": mean(pick("learner_tail_s")), "publish_s": mean(pick("publish_time_s")),
        "exposed_s": mean(exposed),  # step − R: what the learner side adds to the rollout
        "mfu": mean(mfu) if mfu else None,
        "peak_mem": max(pick("peak_mem_bytes")) if pick("peak_mem_bytes") else None,
        "reward_first": run["metrics"][0].get("reward_mean") if run["metrics"] else None,
        "reward_last": rewards[-1] if rewards else None,
        "stale": sum(pick("stale_sources")),
        # bytes each publication sent (publish.method; docs/design/publication.md), and how
        "publish_bytes": mean(pick("publish/bytes")) if pick("publish/bytes") else None,
        "publish_method": (pick("publish/method") or ["file"])[-1],
    }


def reference(runs: list[dict]) -> int:
    """The run others are compared with: the first sync run, else the first run."""
    return next((i for i, r in enumerate(runs) if r["metrics"][0].get("schedule") == "sync"), 0)


def comparable(ref: dict, s: dict) -> bool:
    """Whether two runs' mean rollout times agree well enough to compare step times."""
    return abs(s["rollout_s"] - ref["rollout_s"]) <= COMPARABLE_ROLLOUT * ref["rollout_s"]


def _legend_outside(ax) -> None:
    """Legend to the right of the axes, never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)


def _save(fig, path: str) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps an outside legend in the image
    plt.close(fig)


def plot_breakdown(runs: list[dict], warmup: int, path: str) -> None:
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(runs) + 2), 4))
    for i, run in enumerate(runs):
        s = summarize(run, warmup)
        bottom = 0.0
        for key, color, label in (("rollout_s", "#4c72b0", "rollout R"),
                                  ("tail_s", "#dd8452", "residual learner tail"),
                                  ("publish_s", "#55a868", "publication")):
            ax.bar(i, s[key], bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += s[key]
        ax.text(i, bottom, f"{s['step_s']:.2f}s", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(runs)), [r["label"] for r in runs], rotation=15, ha="right")
    ax.set_ylabel("mean step wall time (s)")
    ax.set_title(f"Step time breakdown (updates after {warmup} warm-up)")
    ax.margins(y=0.12)  # room for the totals above the bars
    _legend_outside(ax)
    _save(fig, path)


def _last_update(run: dict) -> int:
    return run["metrics"][-1]["policy_version"]


def _rollout_of(run: dict, update: int) -> float | None:
    return next((m["rollout_time_s"] for m in run["metrics"]
                 if m.get("policy_version") == update), None)


def plot_release_traces(runs: list[dict], path: str) -> None:
    """Ready vs service of every source of each run's last update, one panel per run."""
    heights = [max(2.5, 0.12 * len(trace.work(r["traces"])) / max(1, len(r["metrics"])) + 1.5)
               for r in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, run in zip(axes[:, 0], runs):
        update = _last_update(run)
        entries = sorted((r for r in trace.work(run["traces"]) if r.update == update),
                         key=lambda r: r.ready)
        for i, e in enumerate(entries):
            replay = isinstance(e, DeferredRecord) and e.work == "replay"
            ax.plot([e.ready, e.start], [i, i], color="#bbbbbb", lw=1,
                    label="wait" if i == 0 else None)
            ax.plot([e.start, e.end], [i, i], color="#c44e52" if replay else "#4c72b0", lw=4,
                    solid_capstyle="butt", label="service" if i == 0 else None)
            ax.plot(e.ready, i, marker="|", color="black", ms=6,
                    label="ready" if i == 0 else None)
        rollout = _rollout_of(run, update)
        if rollout is not None:
            ax.axvline(rollout, color="black", ls="--", lw=1, label=f"rollout closes (R = "
                       f"{rollout:.2f} s)")
        if not entries:
            ax.text(0.5, 0.5, "no trace records for this update", transform=ax.transAxes,
                    ha="center")
        ax.set_xlabel("seconds since the update started")
        ax.set_ylabel("source (readiness order)")
        ax.set_title(f"{run['label']}: update {update}", fontsize=10)
        _legend_outside(ax)
    fig.tight_layout()
    _save(fig, path)


def plot_utilizations(runs: list[dict], path: str) -> None:
    """Learner busy fraction per rank over each run's last update, one panel per run."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 3 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        update = _last_update(run)
        entries = [r for r in trace.work(run["traces"]) if r.update == update]
        end = max((e.end for e in entries), default=0.0)
        rollout = _rollout_of(run, update)
        rollout = end if rollout is None else rollout
        horizon = max(end, rollout)
        bins = [horizon * i / 100 for i in range(101)]
        for r in sorted({e.rank for e in entries}):
            busy = []
            for a, b in zip(bins[:-1], bins[1:]):
                t = sum(max(0.0, min(b, e.end) - max(a, e.start))
                        for e in entries if e.rank == r)
                busy.append(t / (b - a) if b > a else 0.0)
            ax.step(bins[:-1], busy, where="post", label=f"learner rank {r}")
        ax.axvspan(0, rollout, color="#4c72b0", alpha=0.08,
                   label=f"rollout running (R = {rollout:.2f} s)")
        if not entries:
            ax.text(0.5, 0.5, "no trace records for this update", transform=ax.transAxes,
                    ha="center")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("seconds since the update started")
        ax.set_ylabel("learner busy fraction")
        ax.set_title(f"{run['label']}: learner utilization during update {update}", fontsize=10)
        _legend_outside(ax)
    fig.tight_layout()
    _save(fig, path)


def plot_series(runs: list[dict], key: str, ylabel: str, path: str, scale: float = 1.0) -> bool:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    drew = False
    for run in runs:
        pts = [(m["step"], m[key] * scale) for m in run["metrics"] if m.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=run["label"])
            drew = True
    ax.set_xlabel("update")
    ax.set_ylabel(ylabel)
    if drew:
        _legend_outside(ax)
        _save(fig, path)
    else:
        plt.close(fig)
    return drew


def markdown(runs: list[dict], warmup: int) -> str:
    rows = [summarize(r, warmup) for r in runs]
    i_ref = reference(runs)
    ref = rows[i_ref]
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["| run | updates | step (s) | rollout R (s) | step − R (s) | learner tail (s) | "
             "publish (s) | step speedup vs reference | step − R: reference / run | "
             "MFU active | peak mem (MiB) | reward first → last | stale | "
             "publication (MiB, method) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, s in enumerate(rows):
        same_r = comparable(ref, s)
        speedup = f"{ref['step_s'] / s['step_s']:.2f}×" if same_r else \
            f"– (R {s['rollout_s'] / ref['rollout_s']:.2f}× the reference's)"
        exposed = "–" if s["exposed_s"] <= 0 or ref["exposed_s"] <= 0 else \
            f"{ref['exposed_s'] / s['exposed_s']:.2f}×"
        lines.append(
            f"| {s['run']}{' (reference)' if i == i_ref else ''} | {s['updates']} | "
            f"{s['step_s']:.3f} | {s['rollout_s']:.3f} | {s['exposed_s']:.3f} | "
            f"{s['tail_s']:.3f} | {s['publish_s']:.3f} | {speedup} | {exposed} | "
            f"{fmt(s['mfu'] and 100 * s['mfu'], '.2f')}{'' if s['mfu'] is None else ' %'} | "
            f"{fmt(s['peak_mem'] and s['peak_mem'] / 2**20, '.0f')} | "
            f"{fmt(s['reward_first'], '.3f')} → {fmt(s['reward_last'], '.3f')} | {s['stale']} | "
            f"{fmt(s['publish_bytes'] and s['publish_bytes'] / 2**20, '.2f')} "
            f"{s['publish_method']} |")
    out = "\n".join(lines) + f"\n\nMeans over updates after {warmup} warm-up update(s). " \
        f"Reference: {ref['run']} (the first sync run, else the first run). step − R is what " \
        f"the learner side adds to the rollout (residual tail, optimizer step, publication).\n"
    differ = [s for s in rows if not comparable(ref, s)]
    if differ:
        out += ("\n**Rollout times differ**, so step times do not compare directly: "
                + "; ".join(f"{s['run']} R = {s['rollout_s']:.3f} s vs the reference's "
                            f"{ref['rollout_s']:.3f} s (ratio {s['rollout_s'] / ref['rollout_s']:.2f})"
                            for s in differ)
                + f". Step speedups are shown only for runs whose mean R is within "
                  f"{100 * COMPARABLE_ROLLOUT:.0f} % of the reference's; compare the others by "
                  f"step − R and the learner tail, which leave the rollout out.\n")
    return out


def predicted(runs: list[dict], warmup: int) -> str:
    """Trace-predicted (Eq. 14) vs measured step times and speedup over sync, per run."""
    from tsync_mcore.observability import predict
    lines = ["\n| run | measured step (s) | predicted streaming (s) | predicted sync (s) | "
             "predicted speedup over sync |", "|---|---|---|---|---|"]
    for run in runs:
        try:
            r = predict.analyze_run(run["dir"], warmup=warmup)
        except (ValueError, KeyError, FileNotFoundError, ZeroDivisionError) as e:
            lines.append(f"| {run['label']} | – | – | – | not predictable: {e} |")
            continue
        lines.append(f"| {run['label']} | {r['step_time_measured_mean']:.3f} | "
                     f"{r['T_thundersync_mean']:.3f} | {r['T_sync_mean']:.3f} | "
                     f"{r['speedup_predicted']:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.observability.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, traces/rank*.jsonl)")
    p.add_argument("--compare", nargs="*", default=[], metavar="RUN_DIR",
                   help="more run directories, shown beside the first")
    p.add_argument("--out", default=None,
                   help="where the PNGs and summary.md go (default RUN_DIR/report)")
    p.add_argument("--warmup", type=int, default=1,
                   help="leading updates left out of the means (default 1)")
    args = p.parse_args(argv)
    try:
        runs = [load_run(d) for d in [args.run_dir, *args.compare]]
    except (ReportError, TraceError) as e:  # a missing or damaged run: one line, no traceback
        p.exit(2, f"error: {e}\n")
    out = args.out or os.path.join(args.run_dir, "report")
    os.makedirs(out, exist_ok=True)
    plot_breakdown(runs, args.warmup, os.path.join(out, "step_breakdown.png"))
    plot_release_traces(runs, os.path.join(out, "release_trace.png"))
    plot_utilizations(runs, os.path.join(out, "utilization.png"))
    plot_series(runs, "mfu_active", "trainer active MFU (%)", os.path.join(out, "mfu.png"), 100)
    plot_series(runs, "peak_mem_bytes", "peak memory (MiB)", os.path.join(out, "memory.png"),
                1 / 2**20)
    plot_series(runs, "reward_mean", "mean reward", os.path.join(out, "reward.png"))
    md = "# tsync-mcore run report\n\n" + markdown(runs, args.warmup) + predicted(runs, args.warmup)
    md += "\n" + "\n".join(f"![{n}]({n}.png)" for n in
                           ("step_breakdown", "release_trace", "utilization", "mfu", "memory",
                            "reward") if os.path.exists(os.path.join(out, f"{n}.png")))
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return out


if __name__ == "__main__":
    from tsync_mcore.util import quiet
    quiet.install()
    main()
