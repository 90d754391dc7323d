"""The scripted rollout of tests/test_e2e.py, run on a host of its own (a namespace).

Usage: multihost_rollout.py ADDR PORT RUN_DIR UPDATES PAUSE_VERSION PAUSE_AFTER

Hosts the channel at ADDR:PORT for 2 learner ranks (the run's secret in RUN_DIR), plays
test_e2e's batches (the golden run's), acknowledges every publication, and copies each
published file to RUN_DIR/seen_v{N}.safetensors. After PAUSE_AFTER sources of batch
PAUSE_VERSION it prints PAUSED and waits for a line on stdin, then sends the rest of that
batch and its CloseBatch. At the end (or when a link fails) it prints one line, `END <what
ended it>`, and exits 0.
"""

import os
import shutil
import sys

from tests.helpers.scripted import sources  # the golden run's batches
from tsync_mcore.channel import (  # noqa: E402
    Ack,
    ChannelError,
    CloseBatch,
    Hello,
    Publish,
    RegisterBatch,
    TrajectoryMsg,
    load_or_create_secret,
    open_rollout_side,
)
from tsync_mcore.channel.sources import BatchPlan, assign_groups  # noqa: E402


class Ended(Exception):
    """The learner said something else than the script expects (e.g. a Shutdown)."""


def main(addr: str, port: int, run_dir: str, updates: int, pause_v: int, pause_n: int) -> str:
    secret = load_or_create_secret(os.path.join(run_dir, "channel.secret"))
    links = open_rollout_side(addr, port, 2, timeout_s=120, secret=secret)
    try:
        hello = links[0].recv()
        assert isinstance(hello, Hello), hello

        def serve_publish(v: int) -> None:
            msg = links[0].recv()
            if not (isinstance(msg, Publish) and msg.version == v):
                raise Ended(f"expected Publish of version {v}, got {msg}")
            shutil.copy(msg.path, os.path.join(run_dir, f"seen_v{v}.safetensors"))
            links[0].send(Ack(version=v, ok=True))

        serve_publish(hello.version)
        for v in range(hello.version, updates):
            srcs = sources(v)
            plan = BatchPlan.from_sources(srcs)
            owner = assign_groups(plan, {}, 2)
            for link in links:
                link.send(RegisterBatch(version=v, objective="grpo", groups=plan.groups,
                                        n_turns={}, data_pos=v + 1))
            for n, s in enumerate(srcs):
                if (v, n) == (pause_v, pause_n):
                    print("PAUSED", flush=True)
                    sys.stdin.readline()
                links[owner[s.group_id]].send(TrajectoryMsg(s))
            for link in links:
                link.send(CloseBatch(version=v, rollout_time_s=0.1, n_sources=len(srcs)))
            serve_publish(v + 1)
        return "finished"
    except (ChannelError, Ended) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        for link in links:
            link.close()


if __name__ == "__main__":
    a = sys.argv[1:]
    print("END", main(a[0], int(a[1]), a[2], int(a[3]), int(a[4]), int(a[5])), flush=True)
