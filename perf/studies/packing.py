"""Packed vs one-by-one serving: the learner time of a sync update, in process, on the CPU.

    python -m perf.studies.packing [--objectives grpo,opd] [--reps 4] [--batch 64]

The overlap benchmark's model (Qwen2 shapes, hidden 128, 4 layers, vocabulary 1024) and
batch (`perf.bench.workload.Workload`: GRPO groups of 4 sharing a 16-token prompt, 24–192 tokens; OPD
4 turns each), one learner per setting (`learner.max_tokens_per_pass` 0 and the default),
updates alternated so both see the same machine; the first update of each is a warm-up.
Prints the mean update time (begin → close, step included) and the ratio.
"""

import argparse
import os
import statistics
import tempfile

import torch

from tsync_mcore.config import load_config
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.update import Learner
from tsync_mcore.model.parallel import init_parallel

from perf.bench.model import bench_model
from perf.bench.plan import PACK_DEFAULT
from perf.bench.workload import Workload, timed_update


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objectives", default="grpo,opd")
    p.add_argument("--reps", type=int, default=4, help="updates per setting, the first a warm-up")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    if args.reps < 2:
        p.error("--reps must be >= 2 (the first update is a warm-up)")
    torch.set_num_threads(1)
    hf = bench_model(os.path.join(tempfile.mkdtemp(prefix="tsync-packing-"), "model"))
    par = init_parallel(tp_size=1)
    for objective in args.objectives.split(","):
        learners = {}
        for pack in (0, PACK_DEFAULT):
            cfg = load_config(None, {"model.hf_dir": hf, "learner.objective": objective,
                                     "learner.schedule": "sync", "learner.k_open": 16,
                                     "learner.max_tokens_per_pass": pack})
            learners[pack] = Learner(cfg.learner, Policy(cfg, par=par))
        work = Workload(objective=objective, batch=args.batch)
        times: dict[int, list[float]] = {pack: [] for pack in learners}
        for rep in range(args.reps):
            for pack, learner in learners.items():
                dt, _ = timed_update(learner, work, draw=rep)
                if rep:
                    times[pack].append(dt)
        one, packed = (statistics.mean(times[k]) for k in (0, PACK_DEFAULT))
        print(f"{objective} sync B={args.batch}: one by one {one:.3f}s, packed "
              f"(max_tokens_per_pass={PACK_DEFAULT}) {packed:.3f}s, ratio {one / packed:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
