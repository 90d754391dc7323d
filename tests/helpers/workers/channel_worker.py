"""The far end of a channel link for tests/test_channel.py, run as its own process.

    channel_worker.py learner PORT N_BENCH   learner rank 0 of 1: Hello, check the sample
        messages, Publish, echo N_BENCH trajectories (a Publish each), Shutdown. A 1-rank
        default gloo group is initialised first and checked afterwards: the channel must
        not disturb it.
    channel_worker.py reject PORT            learner rank 0 of 1: Hello; for each TrajectoryMsg
        a Rejected naming it, until a DropGroup arrives, which it echoes back as the reason of
        a Shutdown.
    channel_worker.py idle PORT              learner rank 0 of 1: Hello, then wait to be killed.
    channel_worker.py idle_rollout PORT      rollout side for 1 learner: Ack, then wait.

Prints `RESULT {json}` when it finishes on its own.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from tests.helpers.dist_util import emit  # noqa: E402
from tsync_mcore.channel import (
    Ack,
    CloseBatch,
    DropGroup,
    Hello,
    Publish,
    RegisterBatch,
    Rejected,
    Shutdown,
    TrajectoryMsg,
    TurnMsg,
    open_learner_side,
    open_rollout_side,
)
from tsync_mcore.channel.sources import TrajectorySource, TurnSource

SECRET = b"tsync channel test secret, not for runs"  # both test processes use it
HELLO = Hello(version=3, data_pos=17)
PUBLISH = Publish(version=4, path="/ckpt/θ_4 ü")


def sample_rollout_messages() -> list:
    """Every rollout → learner type, with the awkward cases: unicode, None, empty maps."""
    traj = TrajectorySource(traj_id="τ-0 ✓", group_id="g/0", tokens=(5, 0, 2**40, 7),
                            scored_mask=(0, 0, 1, 1), reward=-0.25, policy_version=3,
                            ready_order=2, prompt_len=None)
    turn = TurnSource(traj_id="t1", group_id="组1", turn=1, n_turns=3, start=4,
                      tokens=(9, 8, 7), scored_mask=(0, 1, 1),
                      teacher_logprobs=(None, -0.5, -1e-300), policy_version=3,
                      ready_order=5, prompt_len=2)
    return [
        RegisterBatch(version=3, objective="grpo", groups={"g/0": ["τ-0 ✓", "t1"], "g1": []},
                      n_turns={}, data_pos=40),
        RegisterBatch(version=3, objective="opd", groups={}, n_turns={"t1": 3}, data_pos=0),
        TrajectoryMsg(traj),
        TrajectoryMsg(TrajectorySource("", "", (1,), (0,), 1.0, 3, 0, 0)),
        TurnMsg(turn),
        CloseBatch(version=3, rollout_time_s=12.5, n_sources=2),
        Ack(version=4, ok=True, error="", reload_time_s=0.75),
        Ack(version=5, ok=False, error="engine 2: OOM ✗", reload_time_s=0.0),
    ]


def bench_message(i: int) -> TrajectoryMsg:
    """A 1k-token trajectory, as in the latency measurement."""
    return TrajectoryMsg(TrajectorySource(
        traj_id=f"b{i}", group_id=f"bg{i // 8}",
        tokens=tuple((i + j) % 151_000 for j in range(1000)),
        scored_mask=(0,) * 200 + (1,) * 800, reward=0.5, policy_version=4, ready_order=i,
        prompt_len=200))


def learner(port: int, n_bench: int, pg_port: int) -> dict:
    # A default group like torchrun's: the channel must leave it alone.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=0,
                            world_size=1)
    link = open_learner_side("127.0.0.1", port, 0, 1, timeout_s=30, secret=SECRET)
    link.send(HELLO)
    mismatches = []
    for want in sample_rollout_messages():
        got = link.recv(10)
        if got != want:
            mismatches.append(f"{want!r} arrived as {got!r}")
    link.send(PUBLISH)
    for i in range(n_bench):
        got = link.recv(10)
        if got != bench_message(i):
            mismatches.append(f"bench message {i} differs")
        link.send(Publish(version=i, path=""))
    link.send(Shutdown("learner done"))
    reply = link.recv(10)
    t = __import__("torch").ones(2)
    dist.all_reduce(t)
    result = {"mismatches": mismatches, "reply": reply.reason,
              "default_pg_ok": dist.is_initialized() and dist.get_world_size() == 1
              and t.tolist() == [1.0, 1.0]}
    link.close()
    dist.destroy_process_group()
    return result


def reject(port: int) -> dict:
    link = open_learner_side("127.0.0.1", port, 0, 1, timeout_s=30, secret=SECRET)
    link.send(HELLO)
    rejected = 0
    while isinstance(msg := link.recv(10), TrajectoryMsg):
        s = msg.source
        link.send(Rejected(s.policy_version, s.group_id, s.traj_id, f"token {s.tokens[0]} ✗"))
        rejected += 1
    assert isinstance(msg, DropGroup), msg
    link.send(Shutdown(f"dropped {msg.group_id} of {msg.version}: {msg.reason}"))
    reply = link.recv(10)
    link.close()
    return {"rejected": rejected, "reply": reply.reason}


def idle(port: int) -> None:
    link = open_learner_side("127.0.0.1", port, 0, 1, timeout_s=30, secret=SECRET)
    link.send(HELLO)
    time.sleep(600)


def idle_rollout(port: int) -> None:
    (link,) = open_rollout_side("127.0.0.1", port, 1, timeout_s=30, secret=SECRET)
    link.send(Ack(version=0, ok=True))
    time.sleep(600)


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "learner":
        out = learner(port, int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "reject":
        out = reject(port)
    elif mode == "idle":
        out = idle(port)
    else:
        out = idle_rollout(port)
    emit(out)
