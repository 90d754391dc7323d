"""One training run: `python launch/run.py --config C [--set K=V ...] [--resume]`.

On one node (the default, --role both) it starts the rollout (launch/rollout.py) and
rollout.n_learners learner ranks under torchrun (launch/learner.py) with free ports for the
channel and torchrun's rendezvous. Across hosts each host starts its own share with the
same config (addresses, ports and interfaces come from it; docs/guide/multihost.md):

    rollout host:    python launch/run.py --config C --role rollout
    learner node i:  python launch/run.py --config C --role learner --node-rank i

Each side gets its CUDA_VISIBLE_DEVICES from launch.rollout_gpus / launch.learner_gpus
(docs/guide/gpu.md). Learner node 0 prints one line per update; logs go to RUN_DIR/logs. If a
side dies the others started here are stopped and the run ends with one `error:` line and
a non-zero exit.
"""

from __future__ import annotations

import argparse

from tsync_mcore.util import quiet

quiet.install()  # first: known-harmless warnings off
from tsync_mcore.cli.launch import (ROLES, add_config_args, config_from_args,  # noqa: E402
                                free_port, resume_version, run_job, set_items)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in run.dir/checkpoints (same "
                        "ranks and model.tp); metrics rows after it are dropped")
    p.add_argument("--keep-port", action="store_true",
                   help="use channel.port from the config instead of a free port (always so "
                        "with --role rollout/learner: every host must use the same one)")
    p.add_argument("--role", choices=ROLES, default="both",
                   help="this host's share: both (one node), rollout, or learner (one learner "
                        "node of launch.nnodes)")
    p.add_argument("--node-rank", type=int, default=0, metavar="I",
                   help="with --role learner: this learner node's index in [0, launch.nnodes)")
    args = p.parse_args()
    fixed = args.keep_port or args.role != "both"
    port = [] if fixed else [f"channel.port={free_port()}"]
    cfg = config_from_args("run", args, extra=port)
    if args.resume and args.role != "rollout":
        # one line and exit 2 if nothing to resume (on this node: run.dir must be shared)
        resume_version(cfg.run.dir, "run" if args.role == "both"
                       else f"run (learner node {args.node_rank})", cfg.launch.nnodes)
    rows = run_job(args.config, [*port, *set_items(args)], cfg, who="run", resume=args.resume,
                   role=args.role, node_rank=args.node_rank)
    if args.role == "rollout":
        print(f"done: the rollout served the run in {cfg.run.dir}", flush=True)
    elif args.node_rank == 0:
        print(f"done: {len(rows)} updates in {cfg.run.dir}", flush=True)
    else:
        print(f"done: learner node {args.node_rank} finished", flush=True)


if __name__ == "__main__":
    main()
