"""`ConfigError` and the checks the sections share: `check` (a failed condition becomes an
error naming its dotted key), GPU lists and host addresses."""

from __future__ import annotations

import ipaddress
import socket


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the dotted key."""


def check(ok: bool, key: str, why: str) -> None:
    """Raise ConfigError naming the dotted `key` (e.g. `learner.k_open`) unless `ok`."""
    if not ok:
        raise ConfigError(f"config key '{key}': {why}")


def gpu_list(text: str) -> list[int] | None:
    """"0,1,2" → [0, 1, 2]; "" → []; None when malformed or repeated."""
    if not text.strip():
        return []
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        return None
    ids = [int(p) for p in parts]
    return ids if len(set(ids)) == len(ids) else None


def resolvable(addr: str) -> bool:
    """True for an IP address or a host name that resolves here."""
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        pass
    try:
        socket.getaddrinfo(addr, None)
        return True
    except (OSError, UnicodeError):
        return False


def loopback(addr: str) -> bool:
    """True for a loopback address or a name that resolves only to loopback ones."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)
