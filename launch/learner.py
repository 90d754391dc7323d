"""Learner launcher: `torchrun --nproc-per-node N launch/learner.py --config C [--resume]`.

Runs alongside `python launch/rollout.py --config C`; both read the same config.
"""

import argparse
import os
import sys

from tsync_mcore import quiet

quiet.install()  # first: known-harmless warnings off, here and in vLLM's spawned engine core
from tsync_mcore.launch import config_or_exit, resume_or_exit, secret_or_exit, stopped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override config keys, e.g. learner.schedule=sync run.updates=4")
    args = p.parse_args()
    cfg = config_or_exit("learner", args.config, args.set)  # before megatron's import noise
    if args.resume:
        resume_or_exit("learner", cfg)
    secret_or_exit("learner", cfg)  # the run's channel secret: created here if no launcher did
    from tsync_mcore.model.parallel import destroy_parallel
    from tsync_mcore.trainer import LearnerStopped, Trainer
    rank = os.environ.get("RANK", "0")
    try:
        Trainer(cfg, resume=args.resume).run()
    except LearnerStopped as e:
        print(f"error: learner stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except BaseException as e:  # one line here; the traceback goes to the run's log
        sys.exit(stopped(f"learner rank {rank}", e, cfg.run.dir))
    destroy_parallel()  # clean finish only (an NCCL teardown on an error path can hang)


if __name__ == "__main__":
    main()
