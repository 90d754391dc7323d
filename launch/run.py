"""One training run on this node: `python launch/run.py --config C [--set K=V ...] [--resume]`.

Starts the rollout (launch/rollout.py) and rollout.n_learners learner ranks under torchrun
(launch/learner.py) with free ports for the channel and torchrun's rendezvous, each with
its CUDA_VISIBLE_DEVICES from launch.rollout_gpus / launch.learner_gpus (docs/gpu.md),
prints one line per update, and writes the logs to RUN_DIR/logs. If either side dies the
other is stopped and the run ends with one `error:` line and a non-zero exit.
"""

from __future__ import annotations

import argparse

from tsync_mcore import quiet

quiet.install()  # first: known-harmless warnings off
from tsync_mcore.launch import (add_config_args, config_from_args, free_port,  # noqa: E402
                                resume_version, run_job)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in run.dir/checkpoints (same "
                        "ranks and model.tp); metrics rows after it are dropped")
    p.add_argument("--keep-port", action="store_true",
                   help="use channel.port from the config instead of a free port")
    args = p.parse_args()
    port = [] if args.keep_port else [f"channel.port={free_port()}"]
    cfg = config_from_args("run", args, extra=port)
    if args.resume:
        resume_version(cfg.run.dir, "run")  # one line and exit 2 if nothing to resume
    overrides = [*port, *[item for group in args.set for item in group]]
    rows = run_job(args.config, overrides, cfg, who="run", resume=args.resume)
    print(f"done: {len(rows)} updates in {cfg.run.dir}", flush=True)


if __name__ == "__main__":
    main()
