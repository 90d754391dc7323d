"""Where this learner process runs: its node among the learner nodes, and which addresses
are this host's. Read from torchrun's environment; no torch import (launchers use it first)."""

from __future__ import annotations

import os
import socket


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def multi_node() -> bool:
    """True when this torchrun job's ranks span more than one node."""
    world = _env_int("WORLD_SIZE", 1)
    return _env_int("LOCAL_WORLD_SIZE", world) < world


def rank_label(rank: int | None = None) -> str:
    """`learner rank R`, with its node and host when the job spans nodes: the name an error
    line gives the process that hit it."""
    rank = _env_int("RANK", 0) if rank is None else rank
    if not multi_node():
        return f"learner rank {rank}"
    return (f"learner rank {rank} (node {_env_int('GROUP_RANK', 0)}, host "
            f"{socket.gethostname()})")


def is_local_address(addr: str) -> bool:
    """True when `addr` (an IP or a host name) is an address of this host (this network
    namespace): binding to it succeeds. A name that does not resolve counts as not local."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(sockaddr)
                return True
        except OSError:
            continue
    return False
