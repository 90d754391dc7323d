"""Plots and a Markdown summary of one run, or several side by side.

    python -m tsync_mcore.report RUN_DIR [--compare OTHER_RUN_DIR ...] [--out DIR] [--warmup N]

Reads only what the learner writes (RUN_DIR/metrics.jsonl, RUN_DIR/traces/rank*.jsonl) and
writes into --out (default RUN_DIR/report): step_breakdown.png (step wall time split into
rollout, residual learner tail and publication, per run — the paper's Figure 4),
release_trace.png (ready vs service of every source of one update), utilization.png
(learner busy fraction over time against the rollout window — Figure 3), mfu.png, memory.png
and summary.md (the table to paste into a discussion).
"""

from __future__ import annotations

import argparse
import json
import os
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tsync_mcore import trace  # noqa: E402
from tsync_mcore.trace import DeferredRecord, TraceError  # noqa: E402


def load_run(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    traces = trace.read_run(run_dir)
    name = os.path.basename(os.path.normpath(run_dir))
    label = f"{name} ({metrics[0]['schedule']})" if metrics else name
    return {"dir": run_dir, "label": label, "metrics": metrics, "traces": traces}


def steady(rows: list[dict], warmup: int) -> list[dict]:
    return rows[warmup:] if len(rows) > warmup else rows


def summarize(run: dict, warmup: int) -> dict:
    rows = steady(run["metrics"], warmup)
    pick = lambda k: [r[k] for r in rows if r.get(k) is not None]  # noqa: E731
    mfu = pick("mfu_active")
    rewards = pick("reward_mean")
    return {
        "run": run["label"], "updates": len(run["metrics"]),
        "step_s": mean(pick("step_wall_time_s")), "rollout_s": mean(pick("rollout_time_s")),
        "tail_s": mean(pick("learner_tail_s")), "publish_s": mean(pick("publish_time_s")),
        "mfu": mean(mfu) if mfu else None,
        "peak_mem": max(pick("peak_mem_bytes")) if pick("peak_mem_bytes") else None,
        "reward_first": run["metrics"][0].get("reward_mean") if run["metrics"] else None,
        "reward_last": rewards[-1] if rewards else None,
        "stale": sum(pick("stale_sources")),
    }


def plot_breakdown(runs: list[dict], warmup: int, path: str) -> None:
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(runs) + 2), 4))
    for i, run in enumerate(runs):
        s = summarize(run, warmup)
        bottom = 0.0
        for key, color, label in (("rollout_s", "#4c72b0", "rollout"),
                                  ("tail_s", "#dd8452", "residual learner tail"),
                                  ("publish_s", "#55a868", "publication")):
            ax.bar(i, s[key], bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += s[key]
        ax.text(i, bottom, f"{s['step_s']:.2f}s", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(runs)), [r["label"] for r in runs], rotation=15, ha="right")
    ax.set_ylabel("mean step wall time (s)")
    ax.set_title(f"Step time breakdown (updates after {warmup} warm-up)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_release_trace(run: dict, update: int, path: str) -> None:
    entries = [r for r in trace.work(run["traces"]) if r.update == update]
    entries.sort(key=lambda r: r.ready)
    rollout = next((m["rollout_time_s"] for m in run["metrics"]
                    if m["policy_version"] == update), None)
    fig, ax = plt.subplots(figsize=(8, max(3, 0.12 * len(entries) + 1.5)))
    for i, e in enumerate(entries):
        replay = isinstance(e, DeferredRecord) and e.work == "replay"
        color = "#c44e52" if replay else "#4c72b0"
        ax.plot([e.ready, e.start], [i, i], color="#bbbbbb", lw=1)
        ax.plot([e.start, e.end], [i, i], color=color, lw=4, solid_capstyle="butt")
        ax.plot(e.ready, i, marker="|", color="black", ms=6)
    if rollout is not None:
        ax.axvline(rollout, color="black", ls="--", lw=1, label="rollout closes (R)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("seconds since the update started")
    ax.set_ylabel("source (readiness order)")
    ax.set_title(f"{run['label']}: update {update} — ready (|), wait (grey), service (bar)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_utilization(run: dict, update: int, path: str) -> None:
    entries = [r for r in trace.work(run["traces"]) if r.update == update]
    if not entries:
        return
    end = max(e.end for e in entries)
    rollout = next((m["rollout_time_s"] for m in run["metrics"]
                    if m["policy_version"] == update), end)
    ranks = sorted({e.rank for e in entries})
    horizon = max(end, rollout)
    bins = [horizon * i / 100 for i in range(101)]
    fig, ax = plt.subplots(figsize=(8, 3))
    for r in ranks:
        busy = []
        for a, b in zip(bins[:-1], bins[1:]):
            t = sum(max(0.0, min(b, e.end) - max(a, e.start))
                    for e in entries if e.rank == r)
            busy.append(t / (b - a) if b > a else 0.0)
        ax.step(bins[:-1], busy, where="post", label=f"learner rank {r}")
    ax.axvspan(0, rollout, color="#4c72b0", alpha=0.08, label="rollout running")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since the update started")
    ax.set_ylabel("learner busy fraction")
    ax.set_title(f"{run['label']}: learner utilization during update {update}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    ax.legend(fontsize=8)
    fig.tight_layout()
    if drew:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def markdown(runs: list[dict], warmup: int) -> str:
    rows = [summarize(r, warmup) for r in runs]
    base = rows[0]["step_s"]
    sync = next((s for s, r in zip(rows, runs) if r["metrics"]
                 and r["metrics"][0]["schedule"] == "sync"), None)
    ref = sync["step_s"] if sync else base
    fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
    lines = ["| run | updates | step (s) | rollout (s) | learner tail (s) | publish (s) | "
             "speedup vs " + ("sync" if sync else "first run") + " | MFU active | "
             "peak mem (MiB) | reward first → last | stale |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        lines.append(
            f"| {s['run']} | {s['updates']} | {s['step_s']:.3f} | {s['rollout_s']:.3f} | "
            f"{s['tail_s']:.3f} | {s['publish_s']:.3f} | {ref / s['step_s']:.2f}× | "
            f"{fmt(s['mfu'] and 100 * s['mfu'], '.2f')}{'' if s['mfu'] is None else ' %'} | "
            f"{fmt(s['peak_mem'] and s['peak_mem'] / 2**20, '.0f')} | "
            f"{fmt(s['reward_first'], '.3f')} → {fmt(s['reward_last'], '.3f')} | {s['stale']} |")
    return "\n".join(lines) + f"\n\nMeans over updates after {warmup} warm-up update(s).\n"


def predicted(runs: list[dict], warmup: int) -> str:
    """Trace-predicted (Eq. 14) vs measured step times and speedup over sync, per run."""
    from tsync_mcore import predict
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
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--compare", nargs="*", default=[])
    p.add_argument("--out", default=None)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    try:
        runs = [load_run(d) for d in [args.run_dir, *args.compare]]
    except TraceError as e:  # a damaged trace: one line, no traceback
        p.exit(2, f"error: {e}\n")
    out = args.out or os.path.join(args.run_dir, "report")
    os.makedirs(out, exist_ok=True)
    plot_breakdown(runs, args.warmup, os.path.join(out, "step_breakdown.png"))
    last = runs[0]["metrics"][-1]["policy_version"]
    plot_release_trace(runs[0], last, os.path.join(out, "release_trace.png"))
    plot_utilization(runs[0], last, os.path.join(out, "utilization.png"))
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
    main()
