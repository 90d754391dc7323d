"""Learner nodes and the rollout on separate hosts, deployed as a user would (docs/guide/multihost.md).

Hosts are network namespaces joined by veth cables to one bridge (tests/netns.py): the
rollout on `rollout`, learner node 0 and node 1 on their own, every address, port and
interface from the config, and each host started with its own `launch/run.py --role ...`.
The channel, torchrun's rendezvous and the learners' gloo collectives cross the veths.

- The demo task trains over three hosts to the same θ, bitwise, as one host with the same
  2 learner ranks, seed and batches (sync schedule, static routing: the batch and every
  rank's serving order are then fixed, and a 2-rank sum is the same in either order; each
  rank runs 1 intra-op thread, as torchrun gives 2 ranks on one node). A slow link (tbf: no
  netem here) under update 1 delays it, not changes it; then the rollout host is unplugged
  mid-run and both learner nodes stop within channel.timeout_s, last checkpoint intact.
- A learner node unplugged mid-batch: learner node 0 stops in its gradient reduce within
  launch.dist_timeout_s with one line naming the lost peer; node 1 as soon as its own wait
  (channel or collective) times out;
  the checkpoint before stays intact. Its first update, over 2 nodes, equals the single-host
  golden run's (tests/conftest.py), bitwise.

Opt-in marker `multihost`: `make test` (and so CI) runs it (TSYNC_MULTIHOST=1); elsewhere
`pytest -m multihost`. Skips, saying why, where namespaces cannot be made.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.netns import hosts_or_skip
from tests.helpers.paths import ROOT

PY = sys.executable


def publish_sets(run_dir) -> list[str]:
    """File publication (the single-host reference): a directory every process sees."""
    return ["publish.method=file", f"publish.dir={run_dir}/publish"]


# Across hosts θ travels over the publication group, on the rollout host's veth, into two
# vLLM replicas (each receives every publication and must acknowledge it).
ACROSS_HOSTS = ["publish.method=dist", "publish.ifname=eth0", "rollout.replicas=2"]


@pytest.fixture
def hosts():
    h = hosts_or_skip(["rollout", "node0", "node1"])
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    """The demo's model shape (launch/demo.py): vLLM's CPU attention needs head_dim >= 32."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    out = str(tmp_path_factory.mktemp("demo_model"))
    make_tiny_checkpoint(out, arch="qwen2", vocab_size=320, hidden=64, layers=2, heads=2,
                         kv_heads=1, intermediate=128, seed=0)
    return out


def env() -> dict:
    # 1 intra-op thread per learner rank on every host: what torchrun gives 2 ranks on one
    # node, so the multi-host ranks compute exactly what the single-host ones do
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def node_sets(h, port: int, dist_timeout_s: float) -> list[str]:
    """The multi-host part of the config: every address, port and interface."""
    return [f"channel.addr={h.addr['rollout']}", f"channel.port={port}", "launch.nnodes=2",
            f"launch.master_addr={h.addr['node0']}", "launch.master_port=29500",
            "launch.ifname=eth0", f"launch.dist_timeout_s={dist_timeout_s}"]


def start_hosts(h, argv: list[str], run_dir, roles=("rollout", "node0", "node1")) -> dict:
    """`launch/run.py ARGV --role ...` on each host; output to run_dir/<host>.out."""
    role = {"rollout": ["--role", "rollout"], "node0": ["--role", "learner", "--node-rank", "0"],
            "node1": ["--role", "learner", "--node-rank", "1"]}
    procs = {}
    for host in roles:
        out = open(os.path.join(run_dir, f"{host}.out"), "w")
        procs[host] = h.popen(host, [PY, os.path.join(ROOT, "launch/run.py"), *argv,
                                     *role[host]],
                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env())
    return procs


def wait_for(pred, timeout_s: float, what: str, procs: dict, every_s: float = 0.2) -> None:
    t0 = time.time()
    while not pred():
        dead = {k: p.returncode for k, p in procs.items() if p.poll() is not None}
        assert not dead, f"{dead} ended while waiting for {what}"
        assert time.time() - t0 < timeout_s, f"no {what} within {timeout_s} s"
        time.sleep(every_s)


def steps_done(run_dir) -> int:
    path = os.path.join(run_dir, "logs", "learner.node0.out")
    if not os.path.exists(path):
        return 0
    return sum(line.startswith("STEP ") for line in open(path))


def error_lines(path) -> list[str]:
    return [line.strip() for line in open(path) if line.startswith("error:")]


def checkpoint_tensors(run_dir, step: int) -> dict[str, torch.Tensor]:
    """Every rank's checkpointed model and optimizer tensors of step_N, after checking the
    files against their digests (what a resume trusts)."""
    ckpt = os.path.join(run_dir, "checkpoints", f"step_{step}")
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert meta["version"] == step and meta["world_size"] == 2
    out = {}
    for r in range(2):
        path = os.path.join(ckpt, f"rank{r}.safetensors")
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        assert open(os.path.join(ckpt, f"rank{r}.sha256")).read().strip() == digest
        out.update({f"rank{r}.{k}": v for k, v in load_file(path).items()
                    if k.startswith(("model.", "optimizer."))})
    return out


def tbf_overlimits(h, host: str) -> int:
    """Packets the tbf on `host`'s cable held back for want of tokens (delayed), both ways."""
    n = 0
    for ns, dev in ((h.switch, h.port[host]), (h.ns[host], "eth0")):
        out = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev],
                             capture_output=True, text=True, check=True).stdout
        assert "tbf" in out, out
        n += int(out.split("overlimits")[1].split()[0])
    return n


@pytest.mark.multihost
@pytest.mark.timeout(600)
def test_demo_task_across_hosts_equals_one_host_then_the_rollout_host_goes(hosts, demo_model,
                                                                           tmp_path):
    one, many = tmp_path / "one_host", tmp_path / "hosts"
    for d in (one, many):
        os.makedirs(d)
    base = [f"model.hf_dir={demo_model}", "rollout.groups_per_batch=4", "learner.schedule=sync",
            "rollout.routing=static", "run.save_every=1", "run.export_hf=false",
            "channel.join_timeout_s=400"]
    # The single-host reference: the same 2 learner ranks, seed and batches (concurrently,
    # in this host's own namespace).
    ref = subprocess.Popen(
        [PY, "launch/run.py", "--config", "tsync_mcore/cli/demo.yaml", "--set", *base,
         f"run.dir={one}", "run.updates=2", "channel.timeout_s=120",
         "channel.ack_timeout_s=120", *publish_sets(one)],
        cwd=ROOT, env=env(), stdout=open(one / "run.out", "w"), stderr=subprocess.STDOUT)
    timeout_s = 20
    argv = ["--config", "tsync_mcore/cli/demo.yaml", "--set", *base, f"run.dir={many}", "run.updates=3",
            f"channel.timeout_s={timeout_s}", f"channel.ack_timeout_s={timeout_s}",
            *node_sets(hosts, 29610, 60), *ACROSS_HOSTS]
    procs = start_hosts(hosts, argv, many)
    try:
        wait_for(lambda: steps_done(many) >= 1, 420, "update 0 across hosts", procs)
        # (c) a slow link to node 1 and to the rollout for update 1: it completes, same θ
        for host in ("node1", "rollout"):
            hosts.slow_link(host, rate="4mbit", burst="1600")
        wait_for(lambda: steps_done(many) >= 2, 120, "update 1 over slow links", procs, 0.05)
        delayed = {host: tbf_overlimits(hosts, host) for host in ("node1", "rollout")}
        # (b) the rollout host is unplugged during update 2 (batch 2 streaming or θ_3 being
        # acknowledged: the rollout generates while the learners checkpoint θ_2)
        hosts.unplug("rollout")
        t_gone = time.time()
        for host in ("node0", "node1"):
            procs[host].wait(timeout=timeout_s + 60)
        stop_s = time.time() - t_gone
        assert ref.wait(timeout=400) == 0, open(one / "run.out").read()[-3000:]
    finally:
        for p in (*procs.values(), ref):
            if p.poll() is None:
                p.kill()
    assert all(n > 0 for n in delayed.values()), delayed
    # node 0 (rank 0, the rollout's peer for acknowledgements) times out on the channel;
    # node 1 on the channel too, or in a collective when node 0 left first
    for host in ("node0", "node1"):
        assert procs[host].returncode != 0
        errors = error_lines(many / f"{host}.out")
        assert len(errors) == 1 and f"learner node {host[-1]}" in errors[0], errors
        assert "intact" in errors[0], errors
    (err0,) = error_lines(many / "node0.out")
    assert f"within {timeout_s} s" in err0 and "checkpoints/step_2" in err0, err0
    assert stop_s < timeout_s + 45, stop_s
    rows = [json.loads(line) for line in open(many / "metrics.jsonl")]
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert all(r["stale_sources"] == 0 and r["trajectories"] == 16 for r in rows)
    for k, r in enumerate(rows):  # both replicas served and loaded every version
        assert r["publish/method"] == "dist" and r["publish/bytes"] > 0, r
        assert r["rollout/replica0_tokens"] > 0 and r["rollout/replica1_tokens"] > 0, r
        assert r["rollout/replica0_version"] == r["rollout/replica1_version"] == k, r
    # θ_2: bitwise what one host computed (one replica, file publication): the samples did
    # not depend on the replica that drew them nor θ on how it travelled
    assert open(many / "checkpoints" / "latest").read().strip() == "step_2"
    a, b = checkpoint_tensors(one, 2), checkpoint_tensors(many, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"\nrollout host gone -> both learner nodes stopped in {stop_s:.1f} s "
          f"(channel.timeout_s {timeout_s}); tbf delayed {delayed} packets; learner tail "
          f"{rows[0]['learner_tail_s']:.2f} s (update 0) -> {rows[1]['learner_tail_s']:.2f} s "
          f"(update 1, slow links); step {rows[0]['step_wall_time_s']:.2f} -> "
          f"{rows[1]['step_wall_time_s']:.2f} s")


def read_lines(proc) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line.strip())
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


@pytest.mark.multihost
@pytest.mark.timeout(300)
def test_learner_node_unplugged_mid_batch_stops_within_the_timeout(hosts, tiny_qwen2, golden,
                                                                   tmp_path):
    run, dist_timeout_s, timeout_s = tmp_path, 15, 15
    rollout = hosts.popen("rollout", [PY, os.path.join(ROOT, "tests/helpers/workers/multihost_rollout.py"),
                                      hosts.addr["rollout"], "29610", str(run), "2", "1", "3"],
                          cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=open(run / "rollout.err", "w"), text=True)
    lines = read_lines(rollout)
    # the golden run's config (test_e2e.start_learner), its learner ranks on two hosts
    argv = ["--config", "configs/grpo_cpu_tiny.yaml", "--set", f"model.hf_dir={tiny_qwen2}",
            f"run.dir={run}", "run.updates=2", "run.save_every=1", "optim.lr=1e-4",
            f"channel.timeout_s={timeout_s}", "channel.join_timeout_s=200",
            "channel.ack_timeout_s=60", "learner.pack_arrivals=false",
            *node_sets(hosts, 29610, dist_timeout_s),
            "publish.method=file", f"publish.dir={run}/publish"]  # the scripted rollout reads the file
    procs = start_hosts(hosts, argv, run, roles=("node0", "node1"))
    try:
        assert lines.get(timeout=240) == "PAUSED", open(run / "rollout.err").read()[-3000:]
        # update 0 crossed two hosts: θ_1 is the single-host golden run's, bitwise
        seen = load_file(str(run / "seen_v1.safetensors"))
        assert all(torch.equal(seen[k], golden["published"][1][k]) for k in seen)
        # (a) node 1's cable is pulled mid-batch 1, once update 0's checkpoint is written (the
        # learners write it while batch 1 streams in); the rest of the batch goes out
        wait_for(lambda: os.path.exists(run / "checkpoints" / "latest"), 60,
                 "update 0's checkpoint", procs)
        hosts.link_down("node1")
        t_down = time.time()
        rollout.stdin.write("go\n")
        rollout.stdin.flush()
        procs["node0"].wait(timeout=dist_timeout_s + 60)
        node0_s = time.time() - t_down
        procs["node1"].wait(timeout=timeout_s + 60)
        node1_s = time.time() - t_down
        end = lines.get(timeout=60)
    finally:
        for p in (*procs.values(), rollout):
            if p.poll() is None:
                p.kill()
    (err0,) = error_lines(run / "node0.out")
    assert "learner rank 0 (node 0" in err0 and "lost its learner peers" in err0, err0
    assert f"launch.dist_timeout_s = {dist_timeout_s}" in err0 and "intact" in err0, err0
    # node 1 stops where it waited: for its sources (channel) or in a collective
    (err1,) = error_lines(run / "node1.out")
    assert "learner rank 1 (node 1" in err1 and (f"within {timeout_s} s" in err1 or
                                                 f"dist_timeout_s = {dist_timeout_s}" in err1), err1
    assert node0_s < dist_timeout_s + 30 and node1_s < timeout_s + 30, (node0_s, node1_s)
    assert end.startswith("END") and "finished" not in end, end  # the rollout saw it too
    # the checkpoint before the fault is whole: the version the golden run had
    assert open(run / "checkpoints" / "latest").read().strip() == "step_1"
    assert checkpoint_tensors(run, 1)
    assert not os.path.exists(run / "checkpoints" / "step_2")
    # Resume per node: node 1 without the shared run.dir's checkpoints (a private empty
    # mount over them) refuses before it starts, naming itself, instead of diverging.
    ckpts = run / "checkpoints"
    p = hosts.run("node1", ["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs none {ckpts} && exec {PY} launch/run.py "
                            + " ".join(f"'{a}'" for a in argv)
                            + " --resume --role learner --node-rank 1"],
                  cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    (refused,) = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert refused.startswith("error: run (learner node 1): --resume: no checkpoint under "
                              f"{run}/checkpoints") and "every node shares" in refused, refused
    assert open(ckpts / "latest").read().strip() == "step_1"  # untouched for everyone else
    print(f"\nnode 1 unplugged -> node 0 stopped in {node0_s:.1f} s (dist_timeout_s "
          f"{dist_timeout_s}), node 1 in {node1_s:.1f} s (channel.timeout_s {timeout_s})")


# --- checked before anything starts (no namespaces needed) ---------------------------------


def test_node_layout_is_checked_with_the_key_named():
    from tsync_mcore.config import ConfigError, load_config
    two = {"launch.nnodes": 2, "launch.master_addr": "10.0.0.2", "launch.master_port": 29500,
           "channel.addr": "10.0.0.1"}
    cfg = load_config(None, {**two, "rollout.n_learners": 4, "model.tp": 2})
    assert (cfg.launch.nnodes, cfg.rollout.n_learners // cfg.launch.nnodes) == (2, 2)
    for bad, key in [({"rollout.n_learners": 3}, "launch.nnodes"),
                     ({"rollout.n_learners": 2, "model.tp": 2}, "model.tp"),
                     ({"launch.master_port": 0}, "launch.master_port"),
                     ({"launch.master_addr": "127.0.0.1"}, "launch.master_addr"),
                     ({"channel.addr": "localhost"}, "channel.addr"),
                     ({"launch.learner_gpus": "0,1"}, "launch.learner_gpus"),
                     ({"launch.ifname": "eth0/1"}, "launch.ifname"),
                     ({"launch.dist_timeout_s": 0}, "launch.dist_timeout_s"),
                     ({"channel.join_timeout_s": -1}, "channel.join_timeout_s")]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_config(None, {**two, **bad})
    assert load_config(None, {**two, "launch.learner_gpus": "0"}).launch.learner_gpus == "0"


def test_node_0_refuses_file_publication_the_rollout_host_cannot_read(tmp_path):
    # channel.addr is not an address of this host: the rollout is elsewhere, and θ's
    # default directory (node-local /dev/shm) would be out of its reach
    p = subprocess.run(
        [PY, "launch/run.py", "--config", "tsync_mcore/cli/demo.yaml", "--set", f"run.dir={tmp_path}",
         "publish.method=file", "channel.addr=192.0.2.1", "launch.nnodes=2",
         "launch.master_addr=192.0.2.2", "launch.master_port=29500", "--role", "learner", "--node-rank", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: run: publish.dir: the rollout "
                                                     "(channel.addr 192.0.2.1) is on another host")
    assert not os.path.exists(tmp_path / "logs")  # refused before anything started


@pytest.mark.multihost
def test_a_rank_that_does_not_share_run_dir_is_named(tmp_path):
    """Two ranks on "two nodes" (LOCAL_WORLD_SIZE 1 each); rank 1 sees a private empty
    mount over run.dir, as a node without the shared filesystem would."""
    import socket
    if os.geteuid() != 0:
        pytest.skip("a private mount over run.dir needs root (unshare -m)")
    run = tmp_path / "run"
    os.makedirs(run)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(ROOT, "tests/helpers/workers/shared_dir_worker.py")
    procs = []
    for rank in (0, 1):
        e = dict(env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
                 PYTHONPATH=ROOT)
        argv = [PY, worker, str(run)] if rank == 0 else [
            "unshare", "-m", "sh", "-c", f"mount -t tmpfs none {run} && exec {PY} {worker} {run}"]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=120) for p in procs]
    said = [o.strip().splitlines()[-1] if o.strip() else e[-2000:] for o, e in out]
    assert said[1].startswith("REFUSED learner rank 1 (node 1, host ") and \
        "does not see run.dir" in said[1] and "every learner node shares" in said[1], said
    assert said[0].startswith("REFUSED learner rank 1 on another node do not see run.dir"), said
