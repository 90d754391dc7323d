"""Readiness channel: wire codec, malformed input, real links between processes, failures."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from tests.helpers.dist_util import REPO_ROOT, free_port, parse_results
from tsync_mcore.channel import (
    MESSAGES,
    WIRE_VERSION,
    Ack,
    ChannelTimeout,
    DropGroup,
    PeerGone,
    Publish,
    Rejected,
    Shutdown,
    open_learner_side,
    open_rollout_side,
)
from tsync_mcore.channel.wire import schema_table

WORKER = os.path.join(REPO_ROOT, "tests", "helpers", "workers", "channel_worker.py")


from tests.helpers.workers import channel_worker as cw  # noqa: E402


def test_docs_wire_md_holds_the_generated_table():
    from tsync_mcore.channel.__main__ import DOCS, embedded_table

    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    assert f"WIRE_VERSION {WIRE_VERSION}" in text
    assert embedded_table(text) == schema_table(), (
        "docs/design/wire.md is stale: run python -m tsync_mcore.channel --update-docs")
    out = subprocess.run([sys.executable, "-m", "tsync_mcore.channel", "--table"], check=True,
                         capture_output=True, text=True, cwd=REPO_ROOT,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT)).stdout
    assert out == schema_table()
    for cls in MESSAGES:
        assert f"| {cls.__name__} |" in out


def _spawn(*args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH"))
                                          if p))
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=30)
    results = parse_results(out)
    assert proc.returncode == 0 and results, f"worker failed (rc {proc.returncode}):\n{err[-3000:]}"
    return results[-1]


def test_two_process_round_trip_and_latency():
    n_bench, port = 200, free_port()
    proc = _spawn("learner", port, n_bench, free_port())
    try:
        (link,) = open_rollout_side("127.0.0.1", port, 1, timeout_s=30, secret=cw.SECRET)
        assert link.recv(30) == cw.HELLO
        for msg in cw.sample_rollout_messages():
            link.send(msg)
        assert link.recv(10) == cw.PUBLISH
        rtts = []
        for i in range(n_bench):
            msg = cw.bench_message(i)
            t0 = time.perf_counter()
            link.send(msg)
            reply = link.recv(10)
            rtts.append(time.perf_counter() - t0)
            assert reply == Publish(version=i, path="")
        assert link.recv(10) == Shutdown("learner done")
        with pytest.raises(PeerGone, match="Shutdown"):
            link.recv(5)
        link.close()
        result = _finish(proc)
    finally:
        proc.kill()
    assert result == {"mismatches": [], "reply": "reply", "default_pg_ok": True}
    ms = sorted(r * 1e3 for r in rtts)
    print(f"\n1k-token TrajectoryMsg + Publish reply round trip over {n_bench}: "
          f"median {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * len(ms))]:.2f} ms, "
          f"min {ms[0]:.2f} ms")
    assert statistics.median(ms) < 50


def test_two_process_rejected_and_drop_group():
    port = free_port()
    proc = _spawn("reject", port)
    try:
        (link,) = open_rollout_side("127.0.0.1", port, 1, timeout_s=30, secret=cw.SECRET)
        assert link.recv(30) == cw.HELLO
        for i in range(3):
            link.send(cw.bench_message(i))
            assert link.recv(10) == Rejected(4, f"bg0", f"b{i}", f"token {i} ✗")
        link.send(DropGroup(4, "bg0", "rank 0 rejected b0 ✓"))
        assert link.recv(10) == Shutdown("dropped bg0 of 4: rank 0 rejected b0 ✓")
        link.close()
        result = _finish(proc)
    finally:
        proc.kill()
    assert result == {"rejected": 3, "reply": "reply"}


@pytest.mark.parametrize("killed", ["learner", "rollout"])
def test_killed_peer_surfaces_fast(killed):
    port = free_port()
    proc = _spawn("idle" if killed == "learner" else "idle_rollout", port)
    try:
        if killed == "learner":
            (link,) = open_rollout_side("127.0.0.1", port, 1, timeout_s=30, secret=cw.SECRET)
            assert link.recv(30) == cw.HELLO
        else:
            link = open_learner_side("127.0.0.1", port, 0, 1, timeout_s=30, secret=cw.SECRET)
            assert link.recv(30) == Ack(0, True)
        t0 = time.monotonic()
        proc.kill()
        with pytest.raises((PeerGone, ChannelTimeout)) as err:
            link.recv(10)
        waited = time.monotonic() - t0
        print(f"\nkilled {killed}: {type(err.value).__name__} {waited * 1e3:.1f} ms after SIGKILL "
              f"({err.value})")
        assert waited < 5
        with pytest.raises((PeerGone, ChannelTimeout)):
            link.send(Ack(1, True) if killed == "learner" else Publish(1, "x"))
        t0 = time.monotonic()
        link.close()
        assert time.monotonic() - t0 < 2
    finally:
        proc.kill()
        proc.communicate(timeout=10)
