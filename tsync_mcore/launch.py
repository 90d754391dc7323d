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


def resume_or_exit(who: str, cfg) -> None:
    """--resume needs a run directory with a checkpoint: one `error:` line and exit 2 if not,
    before any process starts."""
    run_dir = cfg.run.dir
    if not os.path.isdir(run_dir):
        print(f"error: {who}: --resume: run directory {run_dir} does not exist (run.dir; "
              f"start a fresh run without --resume)", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if not os.path.lexists(os.path.join(run_dir, "checkpoints", "latest")):
        print(f"error: {who}: --resume: no checkpoint under {run_dir}/checkpoints (start a "
              f"fresh run without --resume)", file=sys.stderr, flush=True)
        raise SystemExit(2)


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
