"""A live run (learner launcher under torchrun, scripted rollout) in which one update's
gradient is not finite: it is never published nor checkpointed; the run stops with the
reason, and a resume starts from the last good θ (and, configured to drop such a batch,
drops the next poisoned one and goes on: one launch for both)."""

import json
import os
from dataclasses import replace

import torch
from safetensors.torch import load_file

from tests.helpers.scripted import (
    finish,
    register_static,
    rollout_links,
    sources,
    start_learner,
)
from tsync_mcore.channel import (
    Ack,
    ChannelError,
    CloseBatch,
    Hello,
    Publish,
    Shutdown,
    TrajectoryMsg,
)
from tsync_mcore.util.net import free_port

# adv_eps this small lets a group whose rewards differ by 1e-300 overflow its FP32 scale
POISON = ["learner.adv_eps=1e-300", "learner.check_finite=source"]


def poisoned(v):
    srcs = sources(v)
    g = srcs[0].group_id
    members = [s.traj_id for s in srcs if s.group_id == g]
    return [replace(s, reward=1e-300 if s.traj_id == members[1] else 0.0)
            if s.group_id == g else s for s in srcs]


def rollout(port, run, updates, poison_at=None):
    """Play batches until `updates`; batch `poison_at` (first attempt only) is poisoned.
    Returns (published weights by version, notices in order, the learner's Shutdown reason)."""
    links = rollout_links(port, run)
    published, notices = {}, []
    try:
        hello = links[0].recv()
        assert isinstance(hello, Hello)
        v, poison = hello.version, poison_at

        def serve_publish():
            msg = links[0].recv()
            if isinstance(msg, Shutdown):
                return msg
            assert isinstance(msg, Publish), msg
            notices.append(msg.version)
            published.setdefault(msg.version, load_file(msg.path))
            links[0].send(Ack(version=msg.version, ok=True))
            return msg

        serve_publish()
        while v < updates:
            srcs = poisoned(v) if v == poison else sources(v)
            poison = None if v == poison else poison
            owner = register_static(links, v, srcs)
            for s in srcs:
                links[owner[s.group_id]].send(TrajectoryMsg(s))
            for link in links:
                link.send(CloseBatch(version=v, rollout_time_s=0.1, n_sources=len(srcs)))
            try:
                msg = serve_publish()
            except ChannelError:
                return published, notices, links[0].peer_shutdown
            if isinstance(msg, Shutdown):
                return published, notices, msg.reason
            v = msg.version  # the same version again: the learner dropped the batch
        return published, notices, None
    finally:
        for link in links:
            link.close()


def test_non_finite_update_stops_the_run_then_resume_starts_from_the_last_good_theta_and_drops(
        tiny_qwen2, tmp_path):
    run = str(tmp_path)
    port = free_port()
    proc = start_learner(tiny_qwen2, run, port, updates=3, extra=POISON)
    published, notices, reason = rollout(port, run, 3, poison_at=1)
    rc, out, err = finish(proc)
    assert rc != 0 and notices == [0, 1]
    bad_group = poisoned(1)[0].group_id
    assert "reduced gradient is not finite" in reason and f"group '{bad_group}'" in reason, reason
    assert "reduced gradient is not finite" in err and "θ and the last checkpoint are intact" in err
    # each rank's one line (torchrun's own report of a failed child follows it)
    assert sum(line.startswith("error: learner stopped: learner rank") for line in
               err.splitlines()) == 2, err[-3000:]
    assert not os.path.exists(os.path.join(run, "publish", "policy_v2.safetensors"))
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == "step_1"
    assert not os.path.exists(os.path.join(run, "checkpoints", "step_2"))
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1]
    # The trace says what happened: update 1 did not step, and which source broke it.
    recs = [json.loads(line) for line in open(os.path.join(run, "traces", "rank0.jsonl"))
            if '"kind": "update"' in line]
    assert [(r["update"], r["ok"]) for r in recs] == [(0, True), (1, False)]

    # Resume, with learner.on_nonfinite: drop_batch and batch 2 poisoned: the learner's first
    # publication is θ_1, bit for bit; the poisoned batch is dropped (θ_2 again, a row that
    # did not step, no checkpoint) and the run goes on to θ_3.
    port = free_port()
    proc = start_learner(tiny_qwen2, run, port, updates=3,
                         extra=POISON + ["learner.on_nonfinite=drop_batch"], flags=["--resume"])
    resumed, notices, reason = rollout(port, run, 3, poison_at=2)
    rc, out, err = finish(proc)
    assert rc == 0 and reason is None, err[-3000:]
    assert notices == [1, 2, 2, 3]  # θ_2 again after the dropped batch, then θ_3
    assert all(torch.equal(resumed[1][k], published[1][k]) for k in published[1])
    assert "batch dropped" in err and "reduced gradient is not finite" in err
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [(r["step"], r["ok"]) for r in rows] == [(1, True), (2, True), (2, False), (3, True)]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == \
        ["latest", "step_1", "step_2", "step_3"]
    assert any(not torch.equal(resumed[2][k], resumed[3][k]) for k in resumed[2])
