"""Hosts made of Linux network namespaces, for tests that deploy across "machines".

`Hosts(["rollout", "node0", "node1"])` builds one namespace per host and a switch
namespace holding a bridge; each host has an `eth0` (10.77.0.<i+1>/24) whose veth peer is a
port of that bridge, so hosts reach each other only through it, as separate machines on one
network would. Nothing is created in the caller's namespace: the whole fabric lives in the
session's own namespaces (names carry the pid and a random tag, so concurrent sessions do
not collide) and `close()` deletes them, which also removes every veth and kills nothing
else. Faults act on the wire: `link_down(host)` / `link_up(host)` unplug a host's cable at
the switch, `unplug(host)` deletes it, `slow_link(host, ...)` shapes what the switch sends
to it with `tbf` (the only delaying qdisc some kernels have: no `netem`).

`hosts_or_skip()` is the pytest entry point: it skips, naming why, where namespaces cannot
be made (not root, no `ip`, no netns support).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

SUBNET = "10.77.0"


class NetnsError(RuntimeError):
    """A namespace command failed; the message holds the command and its stderr."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


class Hosts:
    def __init__(self, names: list[str]):
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.prefix = f"tsm{tag}"
        self.switch = f"{self.prefix}-sw"
        self.ns = {n: f"{self.prefix}-{n}" for n in names}
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        self.port = {n: f"p{i}" for i, n in enumerate(names)}  # switch side of n's cable
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.switch, *self.ns.values()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for name, ns in self.ns.items():
            port = self.port[name]
            _ip("link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    # --- running things on a host -----------------------------------------------------------

    def cmd(self, host: str, argv: list[str]) -> list[str]:
        """argv run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(host, argv), **kw)

    def run(self, host: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(host, argv), **kw)

    # --- faults on the wire -------------------------------------------------------------------

    def link_down(self, host: str) -> None:
        """Unplug `host`'s cable at the switch: its packets go nowhere, nobody is told."""
        _ip("-n", self.switch, "link", "set", self.port[host], "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port[host], "up")

    def unplug(self, host: str) -> None:
        """Delete `host`'s cable (both veth ends): the host is gone from the network."""
        _ip("-n", self.switch, "link", "del", self.port[host])

    def slow_link(self, host: str, rate: str = "2mbit", burst: str = "3000",
                  latency: str = "2s") -> None:
        """Shape both directions of `host`'s cable with tbf: every packet waits its
        serialization time at `rate` plus the queue ahead of it (up to `latency`)."""
        for ns, dev in ((self.switch, self.port[host]), (self.ns[host], "eth0")):
            _ip("-n", ns, "link", "set", dev, "up")  # no-op when up
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", burst, "latency", latency],
                           check=True, capture_output=True, timeout=30)

    def fast_link(self, host: str) -> None:
        for ns, dev in ((self.switch, self.port[host]), (self.ns[host], "eth0")):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)

    # --- teardown -----------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Processes still inside this fabric's host namespaces."""
        out = []
        for ns in self.ns.values():
            p = _ip("netns", "pids", ns, check=False)
            out += [int(x) for x in p.stdout.split()]
        return out

    def close(self) -> None:
        """Kill what still runs in the hosts' namespaces, then delete every namespace (and
        with them every veth and the bridge). Safe to call twice."""
        import signal
        for pid in self.pids() if self._made else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []


def why_no_netns() -> str | None:
    """None when this process can build namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"tsmprobe{os.getpid()}"
    p = _ip("netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"ip netns add failed: {p.stderr.strip()}"
    try:
        q = _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
                check=False)
        if q.returncode != 0:
            return f"veth pairs cannot be made: {q.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def hosts_or_skip(names: list[str]) -> Hosts:
    import pytest
    why = why_no_netns()
    if why:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    return Hosts(names)
