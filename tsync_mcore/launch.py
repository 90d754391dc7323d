"""How a process that stopped unexpectedly says so: one line, the traceback in the run dir."""

from __future__ import annotations

import os
import sys
import traceback

from tsync_mcore.safe_files import BadFile


def config_or_exit(who: str, path: str | None, overrides: list[str]):
    """The validated config, or one `error:` line naming the key or file and exit code 2."""
    from tsync_mcore.config import ConfigError, load_config, parse_overrides
    try:
        return load_config(path, parse_overrides(overrides))
    except ConfigError as e:
        print(f"error: {who}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def secret_or_exit(who: str, cfg) -> None:
    """Create (or check) the run's channel secret file, or one `error:` line and exit 2."""
    from tsync_mcore.channel import ChannelError, channel_secret
    try:
        channel_secret(cfg)
    except ChannelError as e:
        print(f"error: {who}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def stopped(who: str, e: BaseException, run_dir: str) -> int:
    """Print one line naming what stopped, why and where the state and traceback are;
    returns the exit code (130 for an interrupt, 4 otherwise)."""
    if isinstance(e, KeyboardInterrupt):
        print(f"{who} interrupted; the last checkpoint under {run_dir}/checkpoints is intact",
              file=sys.stderr, flush=True)
        return 130
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else 1
    if isinstance(e, BadFile):  # an input file the message names; no traceback needed
        print(f"error: {who}: {e}", file=sys.stderr, flush=True)
        return 2
    log = os.path.join(run_dir, "logs", f"{who.replace(' ', '_')}.traceback")
    try:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "w") as f:
            traceback.print_exception(e, file=f)
    except OSError:
        log = "(not written: run dir not writable)"
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    print(f"error: {who} stopped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
          f"{where}. The last checkpoint under {run_dir}/checkpoints is intact; traceback: "
          f"{log}", file=sys.stderr, flush=True)
    return 4


# --------------------------------------------------------------------------- command lines


def add_config_args(p, config_default: str | None = None) -> None:
    """--config, --set (repeatable) and --print-config, the same in every launcher."""
    p.add_argument("--config", required=config_default is None, default=config_default,
                   metavar="YAML", help="the run's config file (keys: docs/config.md)"
                   + (f"; default {config_default}" if config_default else ""))
    p.add_argument("--set", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override config keys, e.g. --set run.updates=4 learner.k_open=2; may "
                        "repeat (--set a=1 --set b=2); each VALUE is read as YAML")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every auto made concrete) as YAML and exit")


def set_items(args) -> list[str]:
    """The --set items of all occurrences, in order."""
    return [item for group in args.set for item in group]


def config_from_args(who: str, args, extra: list[str] = (), log: bool = True):
    """The resolved config of a launcher's arguments (`extra` overrides first, so the user's
    --set wins); with --print-config prints it and exits 0. `log`: print the choices that
    `resolve` made, one line each, to stderr."""
    cfg = config_or_exit(who, args.config, [*extra, *set_items(args)])
    if getattr(args, "print_config", False):
        import yaml

        from tsync_mcore.config import to_dict
        for line in getattr(cfg, "choices", []):
            print(f"# {line}")
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="", flush=True)
        raise SystemExit(0)
    if log:
        for line in getattr(cfg, "choices", []):
            print(f"[config] {line}", file=sys.stderr, flush=True)
    return cfg
