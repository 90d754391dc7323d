"""Full weights vs LoRA, side by side: the streaming learner's state and update time.

    python -m perf.studies.lora [--objectives grpo,opd] [--reps 4] [--batch 64] [--ranks 8,64]

The overlap benchmark's model (Qwen2 shapes, hidden 128, 4 layers, vocabulary 1024) and
batch (`perf.bench.workload.Workload`), under thundersync with learner.k_open 16, in process on one
rank: one learner with every weight trainable and one per LoRA rank (all seven projections),
updates alternated so every setting sees the same machine; the first update of each is a
warm-up. Per setting: trainable parameters (the grad buffers), Adam state bytes, the
accumulators' measured peak and bound, the mean update time (begin → close, step included),
and the ratios to full weights.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from tsync_mcore.config import load_config
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.update import Learner
from tsync_mcore.model.parallel import init_parallel

from perf.bench.model import bench_model
from perf.bench.workload import Workload, timed_update


def _adam_bytes(policy: Policy) -> int:
    out = 0
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        for state in opt.optimizer.state.values():
            out += sum(t.numel() * t.element_size() for t in state.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objectives", default="grpo,opd")
    p.add_argument("--reps", type=int, default=4, help="updates per setting, the first a warm-up")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ranks", default="8,64", help="LoRA ranks to compare with full weights")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.reps < 2:
        p.error("--reps must be >= 2 (the first update is a warm-up)")
    torch.set_num_threads(1)
    hf = bench_model(os.path.join(tempfile.mkdtemp(prefix="tsync-lora-"), "model"))
    par = init_parallel(tp_size=1)
    results = []
    for objective in args.objectives.split(","):
        settings = {"full": 0, **{f"lora r={r}": int(r) for r in args.ranks.split(",")}}
        learners = {}
        for name, rank in settings.items():
            cfg = load_config(None, {"model.hf_dir": hf, "learner.objective": objective,
                                     "learner.schedule": "thundersync", "learner.k_open": 16,
                                     "model.lora.rank": rank, "model.lora.alpha": 2.0 * max(rank, 1),
                                     "optim.lr": 1e-4})
            learners[name] = Learner(cfg.learner, Policy(cfg, par=par))
        work = Workload(objective=objective, batch=args.batch)
        times = {k: [] for k in learners}
        peak = {k: 0 for k in learners}
        bound = {}
        for rep in range(args.reps):
            for name, learner in learners.items():
                dt, s = timed_update(learner, work, draw=rep)
                if rep:
                    times[name].append(dt)
                peak[name] = max(peak[name], s.accum_peak_bytes)
                bound[name] = s.accum_bound_bytes
        full_t = statistics.mean(times["full"])
        for name, learner in learners.items():
            pol = learner.policy
            row = {"objective": objective, "setting": name, "trainable": pol.n_grad_elements,
                   "adam_bytes": _adam_bytes(pol), "accum_peak_bytes": peak[name],
                   "accum_bound_bytes": bound[name],
                   "update_s": round(statistics.mean(times[name]), 4)}
            row["accum_peak_ratio"] = round(peak["full"] / max(1, peak[name]), 1)
            row["speedup"] = round(full_t / row["update_s"], 2)
            results.append(row)
            print(f"{objective} {name:>10}: trainable {row['trainable']:>9,}  Adam "
                  f"{row['adam_bytes'] / 2**20:7.2f} MiB  accumulators peak "
                  f"{peak[name] / 2**20:7.2f} MiB (full / this {row['accum_peak_ratio']}×)  "
                  f"update {row['update_s']:.3f}s ({row['speedup']}× full)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
