"""Free TCP ports for launchers, tests and benchmarks."""

from __future__ import annotations

import random
import socket

# Drawn from [15000, 29000) and below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default), where every outgoing connection and
# every bind to port 0 takes its port: a port the OS hands out there can be taken by the next
# connect() before our caller binds it, which a machine busy with gloo, TCPStore and HTTP
# connections does. In this range only another explicit bind can take it; it also stays
# clear of the default ports of torch.distributed (29500) and of channel.port (29610).
_LOW, _HIGH = 15_000, 29_000
# The OS's entropy, not `random`'s global state: processes that seed `random` alike must not
# draw the same ports.
_draw = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, outside the ephemeral range where it can;
    the OS's choice (bind to port 0) otherwise."""
    lo, hi = _LOW, min(_HIGH, _ephemeral_low())
    for _ in range(64):
        port = _draw.randrange(lo, hi) if hi > lo else 0
        with socket.socket() as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
