"""The channel's shared secret: one file per run, created by whichever launcher starts first.

The file holds 32 random bytes as hex. It is created atomically (written to a private temp
file, then hard-linked to its final name, so no process ever reads a partial secret) and
refused when anyone but its owner could read or replace it.
"""

from __future__ import annotations

import os
import secrets
import stat
from tsync_mcore.channel.errors import ChannelError

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16


def secret_path(cfg) -> str:
    """`channel.secret_file`, or `<run.dir>/channel.secret` when that is empty."""
    return cfg.channel.secret_file or os.path.join(cfg.run.dir, "channel.secret")


def channel_secret(cfg) -> bytes:
    """The run's secret (created on first use); ChannelError names a bad file."""
    return load_or_create_secret(secret_path(cfg))


def load_secret(path: str) -> bytes:
    """Read and check an existing secret file (FileNotFoundError when there is none)."""
    try:
        # O_NOFOLLOW: a symlink fails here (ELOOP); O_NONBLOCK: a FIFO does not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        if os.path.islink(path):
            raise ChannelError(f"channel secret {path}: is a symlink; refusing it") from None
        raise ChannelError(f"channel secret {path}: cannot open ({e.strerror})") from None
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the name points to now
        if not stat.S_ISREG(st.st_mode):
            raise ChannelError(f"channel secret {path}: not a regular file")
        if st.st_uid != os.getuid():
            raise ChannelError(f"channel secret {path}: owned by uid {st.st_uid}, not by this "
                               f"user ({os.getuid()})")
        if st.st_mode & 0o077:
            raise ChannelError(f"channel secret {path}: mode {stat.S_IMODE(st.st_mode):04o} lets "
                               f"group/other read or write it (chmod 600)")
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ChannelError(f"channel secret {path}: not a hex string") from None
    if len(key) < MIN_SECRET_BYTES:
        raise ChannelError(f"channel secret {path}: {len(key)} bytes, need at least "
                           f"{MIN_SECRET_BYTES}")
    return key


def load_or_create_secret(path: str) -> bytes:
    """The secret at `path`; if there is none, a new random one written there (mode 0600).
    Concurrent callers (the launchers, every learner rank) all end up with the same one."""
    try:
        return load_secret(path)
    except FileNotFoundError:
        pass
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}."
                                   f"{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ChannelError(f"channel secret {path}: cannot create ({e.strerror})") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic: the name appears with the whole content
        except FileExistsError:
            pass  # another process was first: use its secret
        except OSError as e:
            raise ChannelError(f"channel secret {path}: cannot create ({e.strerror})") from None
    finally:
        os.unlink(tmp)
    return load_secret(path)
