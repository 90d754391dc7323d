"""A scripted rollout: the test process owns the rollout side of the channel, starts the real
learner launcher under torchrun and replays synthetic batches, so faults can be injected
precisely (tests/integration/test_e2e.py; the session's `golden` run in conftest.py)."""

import os
import subprocess
import sys

from safetensors.torch import load_file

from tests.helpers.batchgen import make_batch
from tests.helpers.paths import ROOT
from tsync_mcore.channel import (
    Ack,
    CloseBatch,
    Hello,
    Publish,
    RegisterBatch,
    TrajectoryMsg,
    load_or_create_secret,
    open_rollout_side,
)
from tsync_mcore.channel.sources import BatchPlan, TrajectorySource, assign_groups
from tsync_mcore.util.net import free_port


def start_learner(hf_dir, run_dir, port, updates=2, extra=(), flags=()):
    sets = [f"model.hf_dir={hf_dir}", f"run.dir={run_dir}", f"run.updates={updates}",
            "run.save_every=1", f"publish.dir={run_dir}/publish", f"channel.port={port}",
            "publish.method=file",  # the scripted rollout reads the published file
            "channel.timeout_s=20", "channel.ack_timeout_s=20", "optim.lr=1e-4",
            # runs are compared bit for bit: each source served as it arrives
            "learner.pack_arrivals=false", *extra]
    os.makedirs(run_dir, exist_ok=True)
    # Logs go to files: an unread pipe fills up with warnings and blocks the learner.
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), os.path.join(ROOT, "launch/learner.py"),
         "--config", os.path.join(ROOT, "configs/grpo_cpu_tiny.yaml"), *flags, "--set", *sets],
        cwd=ROOT, stdout=open(os.path.join(run_dir, "learner.out"), "w"),
        stderr=open(os.path.join(run_dir, "learner.err"), "w"), text=True)
    proc.run_dir = run_dir
    return proc


def rollout_links(port, run_dir):
    """The rollout side of the channel for the 2 learner ranks of the run in `run_dir`,
    authenticated with that run's secret (whoever comes first creates it)."""
    secret = load_or_create_secret(os.path.join(run_dir, "channel.secret"))
    return open_rollout_side("127.0.0.1", port, 2, timeout_s=60, secret=secret)


def sources(version):
    return [TrajectorySource.from_json(r)
            for r in sorted(make_batch(256, n_groups=3, m=3, version=version, seed=1),
                            key=lambda r: r["ready_order"])]


def scripted_rollout(port, updates, run_dir, bad=None, ack_ok=True, stop_after=None,
                     schedules=None):
    """Play `updates` batches for the learner of `run_dir`; return the weights published for
    each version.

    bad(version, sources) → extra malformed sources to interleave; stop_after=(v, n): return
    (links open, learner waiting) after sending n sources of batch v; schedules: version →
    release schedule for that batch (RegisterBatch override).
    """
    links = rollout_links(port, run_dir)
    published = {}
    try:
        hello = links[0].recv()
        assert isinstance(hello, Hello)
        v0 = hello.version  # a resumed learner starts later

        def serve_publish(v):
            msg = links[0].recv()
            assert isinstance(msg, Publish) and msg.version == v
            published[v] = load_file(msg.path)
            links[0].send(Ack(version=v, ok=ack_ok or v == v0,
                              error="" if ack_ok or v == v0 else "replica 0 failed to load"))

        serve_publish(v0)
        for v in range(v0, updates):
            srcs = sources(v)
            plan = BatchPlan.from_sources(srcs)
            owner = assign_groups(plan, {}, 2)
            for link in links:
                link.send(RegisterBatch(version=v, objective="grpo", groups=plan.groups,
                                        n_turns={}, data_pos=v + 1,
                                        schedule=(schedules or {}).get(v)))
            # bad sources go right after the first good one (so a duplicate is a duplicate)
            stream = srcs[:1] + (bad(v, srcs) if bad else []) + srcs[1:]
            for n, s in enumerate(stream):
                if stop_after is not None and (v, n) == stop_after:
                    return published, links
                links[owner[s.group_id]].send(TrajectoryMsg(s))
            for link in links:
                link.send(CloseBatch(version=v, rollout_time_s=0.1, n_sources=len(srcs)))
            if not ack_ok:
                serve_publish(v + 1)
                return published, links
            serve_publish(v + 1)
        return published, links
    except Exception:
        for link in links:
            link.close()
        raise


def run_scripted(hf_dir, run_dir, updates=2, flags=(), extra=(), **rollout):
    """Learner ranks + the scripted rollout to the end: (rc, stdout, stderr, published)."""
    port = free_port()
    proc = start_learner(hf_dir, run_dir, port, updates=updates, extra=extra, flags=flags)
    published, links = scripted_rollout(port, updates, run_dir, **rollout)
    rc, out, err = finish(proc)
    for link in links:
        link.close()
    return rc, out, err, published


def finish(proc, timeout=120):
    proc.wait(timeout=timeout)
    read = lambda name: open(os.path.join(proc.run_dir, name)).read()  # noqa: E731
    return proc.returncode, read("learner.out"), read("learner.err")


def register_static(links, v, srcs, schedule=None) -> dict[str, int]:
    """Register batch v of `srcs` on every rank (static routing; `schedule` overrides the
    learner's for this batch); returns group → owner."""
    plan = BatchPlan.from_sources(srcs)
    for link in links:
        link.send(RegisterBatch(version=v, objective="grpo", groups=plan.groups, n_turns={},
                                data_pos=v + 1, routing="static", schedule=schedule))
    return assign_groups(plan, {}, 2)
