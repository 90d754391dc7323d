"""Learner launcher: `torchrun --nproc-per-node N launch/learner.py --config C [--resume]`.

Runs alongside `python launch/rollout.py --config C`; both read the same config. Across
learner nodes: `torchrun --nnodes M --node-rank I --nproc-per-node N/M --master-addr A
--master-port P launch/learner.py --config C` on each node (what `launch/run.py --role
learner --node-rank I` runs; docs/guide/multihost.md).
"""

import argparse
import os
import sys

from tsync_mcore.util import quiet

quiet.install()  # first: known-harmless warnings off, here and in vLLM's spawned engine core
from tsync_mcore.util import cpus  # noqa: E402

# launch.learner_cpus: this rank's threads on the learner's cores, before any pool starts
cpus.pin_from_env(f"learner rank {os.environ.get('RANK', '0')}")
from tsync_mcore.channel import nodes  # noqa: E402
from tsync_mcore.cli.launch import (add_config_args, check_publish_reach,  # noqa: E402
                                config_from_args, resume_version, say, secret_or_exit, stopped)
from tsync_mcore.util.safe_files import BadFile, check_hf_dir  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in run.dir/checkpoints (same "
                        "ranks and model.tp)")
    args = p.parse_args()
    rank = os.environ.get("RANK", "0")
    who = nodes.rank_label()  # "learner rank R", with node and host when the job spans nodes
    # before megatron's import noise; the choices logged once, by rank 0
    cfg = config_from_args("learner", args, log=rank == "0")
    if args.resume:
        # one line and exit 2 if nothing to resume; a node that does not share run.dir
        # says so here, by name
        resume_version(cfg.run.dir, who, cfg.launch.nnodes)
    try:  # a missing model is named before torch and Megatron load (seconds per rank)
        check_hf_dir(cfg.model.hf_dir)
    except BadFile as e:
        say(f"error: {who}: {e}")
        sys.exit(2)
    if rank == "0":
        check_publish_reach(cfg, who)  # rank 0 writes θ where the rollout must read it
    secret_or_exit("learner", cfg)  # the run's channel secret: created here if no launcher did
    import torch.distributed as dist

    from tsync_mcore.channel import ChannelError
    from tsync_mcore.model.parallel import destroy_parallel
    from tsync_mcore.learner.process import LearnerStopped, Trainer
    try:
        Trainer(cfg, resume=args.resume).run()
    except ChannelError as e:  # joining the channel failed: the message names addr:port
        lead = "" if str(e).startswith("learner rank") else f"{who}: "
        say(f"error: {lead}{e}")
        sys.exit(3)
    except LearnerStopped as e:  # across nodes, name the rank that says it
        lead = "" if str(e).startswith("learner rank") or not nodes.multi_node() else f"{who}: "
        say(f"error: learner stopped: {lead}{e}")
        sys.exit(3)
    except BaseException as e:  # one line here; the traceback goes to the run's log
        if _lost_peer(e, dist):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            say(f"error: {who} lost its learner peers: a torch.distributed operation failed "
                f"({first[:300]}); a learner node is gone, unreachable, or did not answer "
                f"within launch.dist_timeout_s = {cfg.launch.dist_timeout_s:g} s. The last "
                f"checkpoint under {cfg.run.dir}/checkpoints is intact")
            os._exit(5)  # no teardown: it would wait on the peers that are gone
        sys.exit(stopped(who, e, cfg.run.dir))
    destroy_parallel()  # clean finish only (an NCCL teardown on an error path can hang)


def _lost_peer(e: BaseException, dist) -> bool:
    """A collective or the rendezvous failed on the peers' side: timed out, or the
    connection to another rank broke (gloo raises plain RuntimeErrors for these)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("Timed out waiting", "Connection closed by peer",
                            "Connection reset by peer", "Broken pipe"))


if __name__ == "__main__":
    main()
