"""Merge the overlap cells and kernel records into one result file, plot, print a table."""

import argparse
import json
import os
import platform
import sys
from datetime import date

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--overlap", required=True)
    p.add_argument("--kernels", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--plots", required=True, help="prefix for PNG files")
    args = p.parse_args()
    overlap = json.load(open(args.overlap))
    kernels = json.load(open(args.kernels))
    kernels = kernels.get("kernels", kernels) if isinstance(kernels, dict) else kernels
    doc = {"machine": f"{platform.node()} ({os.cpu_count()} CPU cores, {platform.machine()})",
           "date": date.today().isoformat(), "overlap": overlap, "kernels": kernels}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\n{'objective':9s} {'r':>4s} {'B':>4s} {'schedule':12s} {'step s':>7s} "
          f"{'speedup':>8s} {'predicted':>9s} {'meas/pred':>9s} {'tail s':>7s} {'MFU':>6s} "
          f"{'r_eff':>5s} {'wall/cpu':>8s} {'lag ms':>9s} {'policy lag':>10s}")
    for c in overlap:
        print(f"{c['objective']:9s} {c['ratio']:4.1f} {c['batch']:4d} {c['schedule']:12s} "
              f"{c['step_time_s']:7.3f} {c['speedup_measured']:7.2f}x {c['speedup_predicted']:8.2f}x "
              f"{100 * c['measured_over_predicted']:8.0f}% {c['learner_tail_s']:7.3f} "
              f"{100 * c['mfu_active']:5.2f}% {c.get('ratio_effective', float('nan')):5.2f} "
              f"{c.get('wall_over_cpu', float('nan')):8.3f} "
              f"{c.get('release_lag_ms', float('nan')):4.1f}/{c.get('release_lag_max_ms', float('nan')):<4.0f}"
              f" {c.get('policy_lag_mean', float('nan')):6.2f}/{c.get('policy_lag_max', '-')}")
    cells = sorted({(c["objective"], c["batch"]) for c in overlap})
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.5), squeeze=False)
    for ax, (obj, b) in zip(axes[0], cells):
        for sched, color in (("group_ready", "#dd8452"), ("thundersync", "#4c72b0"),
                             ("one_step_off", "#55a868"), ("fully_async", "#c44e52")):
            pts = sorted((c["ratio"], c["speedup_measured"], c["speedup_predicted"])
                         for c in overlap if (c["objective"], c["batch"], c["schedule"]) ==
                         (obj, b, sched))
            if pts:
                r, m, pr = zip(*pts)
                ax.plot(r, m, marker="o", color=color, label=f"{sched} measured")
                ax.plot(r, pr, ls="--", color=color, label=f"{sched} trace-predicted")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rollout / learner time ratio r")
        ax.set_ylabel("speedup over sync")
        ax.set_title(f"{obj.upper()}, {b} trajectories")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{args.plots}-overlap.png", dpi=110)
    print(f"plots: {args.plots}-overlap.png", file=sys.stderr)


if __name__ == "__main__":
    main()
