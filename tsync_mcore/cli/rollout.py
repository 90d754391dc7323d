"""Rollout launcher: `python launch/rollout.py --config C`, alongside the learner's torchrun.

Hosts the readiness channel (config `channel.addr`/`channel.port`, authenticated with the
run's secret `channel.secret_file`), runs the vLLM engine
and the agent loop, and streams ready sources to the learner ranks.
"""

import argparse
import sys

from tsync_mcore.util import quiet

quiet.install()  # first: known-harmless warnings off, here and in vLLM's spawned engine core
from tsync_mcore.util import cpus  # noqa: E402

# launch.rollout_cpus: the rollout's threads (and vLLM's engine process) on its own cores
cpus.pin_from_env("rollout")


def main() -> None:
    from tsync_mcore.cli.launch import add_config_args, config_from_args, secret_or_exit, stopped
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    args = p.parse_args()
    cfg = config_from_args("rollout", args)
    from tsync_mcore.util.safe_files import BadFile, check_hf_dir
    try:  # a missing model is named before vLLM and torch load (the driver checks it again)
        check_hf_dir(cfg.model.hf_dir)
    except BadFile as e:
        print(f"error: rollout: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    secret_or_exit("rollout", cfg)  # the run's channel secret: created here if no launcher did
    from tsync_mcore.channel import ChannelError
    from tsync_mcore.rollout.driver import RolloutDriver, RolloutStopped
    try:
        RolloutDriver(cfg).run()
    except ChannelError as e:  # hosting the channel failed: the message names addr:port
        print(f"error: rollout: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except RolloutStopped as e:
        print(f"error: rollout stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except BaseException as e:  # one line here; the traceback goes to the run's log
        sys.exit(stopped("rollout", e, cfg.run.dir))


if __name__ == "__main__":
    main()
