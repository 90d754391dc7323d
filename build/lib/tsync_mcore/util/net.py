"""Free TCP ports for launchers, tests and benchmarks."""

from __future__ import annotations

import socket


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
