"""Learner launcher: `torchrun --nproc-per-node N launch/learner.py --config C [--resume]`.

Runs alongside `python launch/rollout.py --config C`; both read the same config.
"""

import argparse
import os
import sys

from tsync_mcore import quiet

quiet.install()  # first: known-harmless warnings off, here and in vLLM's spawned engine core
from tsync_mcore.launch import (add_config_args, config_from_args, resume_version,  # noqa: E402
                                secret_or_exit, stopped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in run.dir/checkpoints (same "
                        "ranks and model.tp)")
    args = p.parse_args()
    rank = os.environ.get("RANK", "0")
    # before megatron's import noise; the choices logged once, by rank 0
    cfg = config_from_args("learner", args, log=rank == "0")
    if args.resume:
        resume_version(cfg.run.dir, "learner")  # one line and exit 2 if nothing to resume
    secret_or_exit("learner", cfg)  # the run's channel secret: created here if no launcher did
    from tsync_mcore.channel import ChannelError
    from tsync_mcore.model.parallel import destroy_parallel
    from tsync_mcore.trainer import LearnerStopped, Trainer
    try:
        Trainer(cfg, resume=args.resume).run()
    except ChannelError as e:  # joining the channel failed: the message names addr:port
        who = "" if str(e).startswith("learner rank") else f"learner rank {rank}: "
        print(f"error: {who}{e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except LearnerStopped as e:
        print(f"error: learner stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except BaseException as e:  # one line here; the traceback goes to the run's log
        sys.exit(stopped(f"learner rank {rank}", e, cfg.run.dir))
    destroy_parallel()  # clean finish only (an NCCL teardown on an error path can hang)


if __name__ == "__main__":
    main()
