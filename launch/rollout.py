"""Rollout launcher: `python launch/rollout.py --config C`, alongside the learner's torchrun.

Hosts the readiness channel (config `channel.addr`/`channel.port`, authenticated with the
run's secret `channel.secret_file`), runs the vLLM engine
and the agent loop, and streams ready sources to the learner ranks.
"""

import argparse
import sys

from tsync_mcore.config import load_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override config keys, e.g. rollout.groups_per_batch=4")
    args = p.parse_args()
    import yaml
    from tsync_mcore.config import ConfigError
    try:
        cfg = load_config(args.config, {k: yaml.safe_load(v) for k, _, v in
                                        (s.partition("=") for s in args.set)})
    except (ConfigError, OSError) as e:
        sys.exit(f"rollout: {e}")
    from tsync_mcore.channel import ChannelError, channel_secret
    try:
        channel_secret(cfg)  # the run's channel secret: created here if no launcher did yet
    except ChannelError as e:
        sys.exit(f"rollout: {e}")
    from tsync_mcore.launch import stopped
    from tsync_mcore.rollout.driver import RolloutDriver, RolloutStopped
    try:
        RolloutDriver(cfg).run()
    except RolloutStopped as e:
        print(f"rollout stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except BaseException as e:  # one line here; the traceback goes to the run's log
        sys.exit(stopped("rollout", e, cfg.run.dir))


if __name__ == "__main__":
    main()
