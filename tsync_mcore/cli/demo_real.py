"""`make demo-real`: a real model learns a real task on this machine.

SmolLM2-135M-Instruct (`make real-model` converts it into runs/models/smollm2-135m-instruct)
trains with GRPO under thundersync on a reasoning-gym task scored by the task's own scorer,
the rollout and the learner each on their own core (tsync_mcore/cli/demo_real.yaml). θ is
evaluated greedily on held-out problems before the first update and every run.eval_every
updates; the last line gives the accuracy it started from, where it ended and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tsync_mcore.util import quiet

quiet.install()  # first: known-harmless warnings off, here and in vLLM's spawned engine core
from tsync_mcore.cli.launch import add_config_args, config_from_args, free_port, run_job

DEMO_REAL_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_real.yaml")


def eval_rows(run_dir: str) -> list[dict]:
    """RUN/eval.jsonl's rows (one per evaluation), in order; [] if there is none."""
    path = os.path.join(run_dir, "eval.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(rows: list[dict], wall_s: float) -> str:
    """The first and the last evaluation's greedy accuracy (eval/pass@1) and the change."""
    if len(rows) < 2:
        return f"done in {wall_s / 60:.1f} min; fewer than two evaluations to compare"
    a, b = rows[0], rows[-1]
    pa, pb = 100 * a["eval/pass@1"], 100 * b["eval/pass@1"]
    return (f"eval accuracy (greedy, {b['eval/n_prompts']} held-out problems): "
            f"θ_{a['eval/policy_version']} {pa:.1f}% → θ_{b['eval/policy_version']} {pb:.1f}% "
            f"({pb - pa:+.1f} points) in {wall_s / 60:.1f} min")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, config_default=DEMO_REAL_CONFIG)
    args = p.parse_args()
    overrides = [f"channel.port={free_port()}", *[i for g in args.set for i in g]]
    cfg = config_from_args("demo-real", args, extra=overrides[:1])
    if not os.path.exists(os.path.join(cfg.model.hf_dir, "config.json")):
        raise SystemExit(f"error: demo-real: no model in {cfg.model.hf_dir} (make real-model "
                         f"writes it)")
    if os.path.exists(os.path.join(cfg.run.dir, "eval.jsonl")):
        os.remove(os.path.join(cfg.run.dir, "eval.jsonl"))  # this run's evaluations only
    t0 = time.time()
    run_job(args.config, overrides, cfg, who="demo-real")
    print("\n" + summary(eval_rows(cfg.run.dir), time.time() - t0), flush=True)


if __name__ == "__main__":
    main()
