"""Publication over torch.distributed (publish.method: dist) into live vLLM engines.

Two RolloutEngines (2 replicas, each one worker) join one publication group with a sender
in this process (learner rank 0) or in a TP=2 torchrun learner. What an engine holds is read
back from the vLLM model itself (`param_digest`: its fused, repacked tensors), and compared
with what a file reload of the same weights (publish.method: file) leaves there.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import secrets
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore
from safetensors.torch import load_file, save_file

from tests.helpers.dist_util import REPO_ROOT, run_dist
from tsync_mcore.channel import Ack, Publish
from tsync_mcore.publication import dist as pd
from tsync_mcore.publication.store import GroupStore, store_key
from tsync_mcore.rollout.engine import EngineThread, RolloutEngine

TINY = dict(arch="qwen2", vocab_size=300, hidden=64, layers=2, heads=2, kv_heads=2)  # TP=2 splits
BUCKET = 48 << 10  # several buckets for the tiny model, one parameter over a bucket


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("publish_ckpts")
    return [make_tiny_checkpoint(str(root / n), seed=s, **TINY) for n, s in (("a", 0), ("b", 1))]


@pytest.fixture(scope="module")
def rig(ckpts):
    et = EngineThread()

    async def make():
        return RolloutEngine(ckpts[0], max_model_len=128, seed=0)

    engines = [et.run(make()), et.run(make())]
    yield et, engines
    for e in engines:
        et.run(e.aclose())
    et.close()


KEY = pd.group_key(b"s" * 32, "t")


def open_group(et, engines, timeout_s=30.0, key=KEY):
    """The store here, learner rank 0 in a thread, the engines' workers as ranks 1, 2, all
    proving `key`; returns (rank 0's group, the store)."""
    store = pd.host_store("127.0.0.1", 0, timeout_s, key)
    token, world, out = secrets.token_hex(8), 1 + len(engines), {}

    def rank0():
        try:
            out["pg"] = pd.join_group("127.0.0.1", store.port, 0, world, token=token,
                                      timeout_s=timeout_s, key=key)
        except pd.PublishError as e:
            out["error"] = e
    th = threading.Thread(target=rank0)
    th.start()

    async def join():
        return await asyncio.gather(*[e.join_publish_group(
            "127.0.0.1", store.port, 1 + i, world, token=token, timeout_s=timeout_s,
            key=key.hex()) for i, e in enumerate(engines)])

    try:
        assert et.run(join()) == [[1], [2]]
    finally:
        th.join()
    if "error" in out:
        raise out["error"]
    store.clear()  # as the rollout does once formed
    return out["pg"], store


def test_a_member_without_the_runs_secret_is_refused_before_any_weight(rig, ckpts):
    """The store answers only members proving the run's secret: a process that tries to
    join as rank 0 with another key is refused by the store itself (one line), before it
    can read or write anything there; members holding the key form the group. Once formed
    the store is empty, and an outsider can neither list it nor park a value there."""
    et, engines = rig
    before = digests(et, engines)
    store = pd.host_store("127.0.0.1", 0, 20, KEY)
    with pytest.raises(pd.PublishError, match=r"^publication group at 127\.0\.0\.1:\d+ \(rank "
                       r"0 of 3\): publication store at .* refused this member: it did not "
                       r"prove the run's secret"):
        pd.join_group("127.0.0.1", store.port, 0, 3, token="t", timeout_s=20,
                      key=pd.group_key(b"x" * 32, "t"))
    assert store.refused == 1
    store.close()
    assert digests(et, engines) == before
    pg, store = open_group(et, engines, timeout_s=20)
    assert pg is not None
    with pytest.raises(Exception, match="Ping failed|invalid value"):  # not a c10d store
        TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=2))
    with pytest.raises(pd.PublishError, match="refused this member"):
        pd.join_group("127.0.0.1", store.port, 0, 3, token="t", timeout_s=5,
                      key=pd.group_key(b"x" * 32, "t"))
    assert store.refused >= 2
    member = GroupStore("127.0.0.1", store.port, store_key(KEY), 5)  # the group's own view
    assert member.num_keys() == 0
    member.close()
    digests(et, engines)  # the engines go on


def test_an_outsider_racing_for_rank_0_neither_stops_the_run_nor_gets_weights_in(
        rig, ckpts, tmp_path):
    """The rollout's open_group and the learner's Publisher over a real channel, while a
    local process outside the run connects to the store's port first, holds an idle
    connection there, and tries to read the group's token and join as rank 0 before the
    learner: it gets nothing, the group forms, θ_b arrives and is acknowledged, and the
    engine holds what a file reload of θ_b gives."""
    from tests.helpers.links import link_pair
    from tests.helpers.workers.channel_worker import SECRET
    from tsync_mcore.config import load_config
    from tsync_mcore.publication import receive
    from tsync_mcore.publication.send import Publisher
    from tsync_mcore.util.net import free_port

    et, engines = rig
    engine = engines[0]
    et.run(engine.reload_weights(os.path.join(ckpts[0], "model.safetensors")))
    secret_file = tmp_path / "channel.secret"
    secret_file.write_text(SECRET.hex())
    secret_file.chmod(0o600)
    port = free_port()
    cfg = load_config(None, {"model.hf_dir": ckpts[1], "run.dir": str(tmp_path),
                             "publish.method": "dist", "publish.port": port,
                             "channel.addr": "127.0.0.1", "channel.secret_file": str(secret_file),
                             "channel.ack_timeout_s": 10})
    outsider = subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "tests/helpers/workers/publish_outsider.py"),
         str(port), "2", "20"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert outsider.stdout.readline().strip() == "READY"
    theta = load_file(os.path.join(ckpts[1], "model.safetensors"))
    policy = SimpleNamespace(par=SimpleNamespace(rank=0), gathers_to_export=False,
                             device=torch.device("cpu"), iter_params=lambda: iter(theta.items()))
    with link_pair(timeout_s=30) as (rollout_link, learner_link):
        out = {}

        def rollout():
            try:
                out["store"] = receive.open_group(cfg, rollout_link, engine, et)
                msg = receive.await_publish(rollout_link, 1, 30, "", method="dist")
                et.run(receive.reload(engine, rollout_link, msg))
            except Exception as e:  # noqa: BLE001 — surfaced below
                out["error"] = e
        th = threading.Thread(target=rollout)
        th.start()
        time.sleep(3)  # the outsider's head start: it polls the port every 50 ms
        try:
            pub = Publisher(cfg.publish, cfg.channel, policy, learner_link, str(tmp_path),
                            secret=SECRET)
            pub.publish(1)
            ack = learner_link.recv(timeout_s=30)
        finally:
            th.join()
            outsider.kill()
            seen = outsider.communicate()[0]
    assert "error" not in out, out["error"]
    assert isinstance(ack, Ack) and ack.ok and ack.version == 1, ack
    assert "STORE REFUSED" in seen and "TOKEN" not in seen and "JOINED" not in seen, seen
    assert out["store"].refused >= 1
    out["store"].close()
    assert file_digest(et, engine, os.path.join(ckpts[1], "model.safetensors")) \
        == et.run(engine.param_digest())
    assert engine.bytes_received == pub.stats["publish/bytes"]
    et.run(engine.reload_weights(os.path.join(ckpts[0], "model.safetensors")))  # as it was


def receive_all(et, engines, msg):
    async def go():
        return await asyncio.gather(*[e.receive_weights(msg) for e in engines],
                                    return_exceptions=True)
    return et.run(go())


def publish(et, engines, sender, version, named):
    """Broadcast from a thread while every engine receives; the sender's stats."""
    out = {}

    def send():
        try:
            out["st"] = sender.publish(version, named)
        except Exception as e:  # noqa: BLE001 — surfaced below
            out["err"] = e

    th = threading.Thread(target=send)
    th.start()
    msg = Publish(version=version, path="", method="dist", n_buckets=len(sender.buckets),
                  delta=sender.delta)
    res = receive_all(et, engines, msg)
    th.join()
    for r in res:
        if isinstance(r, BaseException):
            raise r
    assert "err" not in out, out.get("err")
    return out["st"]


def digests(et, engines):
    return [et.run(e.param_digest()) for e in engines]


def file_digest(et, engine, path):
    et.run(engine.reload_weights(path))
    return et.run(engine.param_digest())


def test_dist_gives_the_replicas_the_file_reloads_weights_tp1(rig, ckpts, parallel1):
    """A TP=1 learner's θ (its live export, iterated) over the group into 2 replicas."""
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy

    et, engines = rig
    start = digests(et, engines)
    cfg = load_config(None, {"model.hf_dir": ckpts[1], "model.dtype": "fp32",
                             "run.dir": "/tmp/unused"})
    policy = Policy(cfg, par=parallel1)
    pg, _store = open_group(et, engines)
    sender = pd.Sender(pg, pd.params_of(policy.iter_params()), BUCKET)
    st = publish(et, engines, sender, 1, policy.iter_params())
    assert st.buckets == len(sender.buckets) > 2
    assert all(e.bytes_received == st.bytes for e in engines)
    got = digests(et, engines)
    assert got[0] == got[1] != start[0]
    # the same weights through a file: bitwise the same parameters in the vLLM model
    assert file_digest(et, engines[0], os.path.join(ckpts[1], "model.safetensors")) == got[0]


def test_dist_from_a_tp2_learner_gathers_per_tensor(rig, ckpts, tmp_path):
    et, engines = rig
    for e in engines:  # start from θ_a, so that receiving θ_b shows
        et.run(e.reload_weights(os.path.join(ckpts[0], "model.safetensors")))
    want = file_digest(et, engines[1], os.path.join(ckpts[1], "model.safetensors"))
    et.run(engines[1].reload_weights(os.path.join(ckpts[0], "model.safetensors")))
    store = pd.host_store("127.0.0.1", 0, 120, KEY)
    token = secrets.token_hex(8)
    out = {}
    th = threading.Thread(target=lambda: out.update(res=run_dist(
        [os.path.join(REPO_ROOT, "tests/helpers/workers/publish_worker.py"), ckpts[1], "2",
         "127.0.0.1", str(store.port), "3", token, str(BUCKET), KEY.hex()], nproc=2,
        timeout=240)))
    th.start()

    async def join():
        return await asyncio.gather(*[e.join_publish_group(
            "127.0.0.1", store.port, 1 + i, 3, token=token, timeout_s=120, key=KEY.hex())
            for i, e in enumerate(engines)])

    et.run(join())
    member = GroupStore("127.0.0.1", store.port, store_key(KEY), 120)
    n = int(member.get("n_buckets"))  # the worker tells it through the store (the notice's)
    member.close()
    res = receive_all(et, engines, Publish(version=1, path="", method="dist", n_buckets=n))
    th.join()
    assert not any(isinstance(r, BaseException) for r in res), res
    assert out["res"][0]["buckets"] == n and out["res"][0]["sent"] == engines[0].bytes_received
    assert digests(et, engines) == [want, want]


def _perturb(tensors, gen, share):
    """A new θ: `share` of each tensor's elements changed (0: θ as it was)."""
    out = {}
    for k, t in tensors.items():
        t = t.clone()
        if share:
            mask = torch.rand(t.shape, generator=gen) < share
            t[mask] += torch.randn(int(mask.sum()), generator=gen) * 1e-3
        out[k] = t
    return out


def test_delta_publication_matches_the_full_one_after_every_update(rig, ckpts, tmp_path):
    """10 updates, sparse, dense and empty deltas: each replica's checksum (its ack's) is
    the learner's, and its parameters equal a file reload of the same θ."""
    et, engines = rig
    theta = load_file(os.path.join(ckpts[1], "model.safetensors"))
    pg, _store = open_group(et, engines)
    sender = pd.Sender(pg, pd.params_of(theta.items()), BUCKET, delta=True, dense_frac=0.25)
    gen = torch.Generator().manual_seed(0)
    full_bytes = None
    for v, share in enumerate([None, 0.01, 0.01, 0.6, 0.0, 0.001, 0.01, 0.3, 0.02, 0.01], 1):
        if share is not None:
            theta = _perturb(theta, gen, share)
        st = publish(et, engines, sender, v, list(theta.items()))
        assert [e.checksums for e in engines] == [[st.checksum]] * 2, v
        if share is None:
            full_bytes = st.bytes
            assert st.full and st.sparse_buckets == 0
        elif share <= 0.02:
            assert st.sparse_buckets == st.buckets and st.bytes < full_bytes / 2, (v, st)
        elif share >= 0.3:  # denser than publish.delta_dense: buckets go whole
            assert st.sparse_buckets == 0 and st.bytes >= full_bytes
        path = str(tmp_path / f"theta_{v}.safetensors")
        save_file(theta, path)
        held = et.run(engines[0].param_digest())
        assert file_digest(et, engines[1], path) == held, v


def test_a_drifted_replica_gets_the_whole_model_next(tmp_path):
    """The learner side of the checksum: a mismatched ack makes the next publication whole."""
    from tsync_mcore.config import PublishConfig
    from tsync_mcore.publication.send import Publisher

    store = pd.host_store("127.0.0.1", 0, 10, KEY)
    pg = pd.join_group("127.0.0.1", store.port, 0, 1, token="solo", timeout_s=10, key=KEY)
    theta = {"w": torch.randn(1000), "b": torch.randn(10)}
    pub = Publisher(PublishConfig(delta=True), None,
                    SimpleNamespace(par=SimpleNamespace(rank=0, tp_size=1)), None, str(tmp_path))
    pub.sender = pd.Sender(pg, pd.params_of(theta.items()), 4096, delta=True)
    for v in (1, 2):
        theta["w"][v] += 1.0
        pub.checksums[v] = pub.sender.publish(v, theta.items()).checksum
    assert pub.check_ack(Ack(version=1, ok=True, checksum=pub.checksums[1])) == ""
    why = pub.check_ack(Ack(version=2, ok=True, checksum=f"{pub.checksums[2]},0000"))
    assert "θ_2" in why and "sent whole" in why and pub.sender.force_full
    theta["w"][3] += 1.0
    st = pub.sender.publish(3, theta.items())
    assert st.full and st.sparse_buckets == 0 and not pub.sender.force_full


def _bad_publication(pg, version, header: bytes, n_buckets: int, metas=None):
    """What a broken learner could send: the control block, `header`, then (a delta
    publication) `metas`."""
    delta = metas is not None
    pd._bcast(pg, torch.tensor([pd.MAGIC, version, len(header), n_buckets, int(delta), 1]))
    pd._bcast(pg, torch.frombuffer(bytearray(header), dtype=torch.uint8))
    if delta:
        pd._bcast(pg, torch.tensor(metas, dtype=torch.int64))


def test_bad_publications_fail_in_one_line_and_leave_the_weights(rig, ckpts):
    et, engines = rig
    theta = load_file(os.path.join(ckpts[0], "model.safetensors"))
    params = pd.params_of(theta.items())
    before = digests(et, engines)
    pg, _store = open_group(et, engines, timeout_s=10)
    good = pd.encode_header(params, BUCKET)
    n = len(pd.plan_buckets(params, BUCKET))
    renamed = pd.encode_header([pd.Param("model.nope", p.dtype, p.shape) if i == 3 else p
                                for i, p in enumerate(params)], BUCKET)
    reshaped = pd.encode_header([pd.Param(p.name, p.dtype, (p.shape[0] + 1, *p.shape[1:]))
                                 if i == 0 else p for i, p in enumerate(params)], BUCKET)
    cases = [
        (b"{not json", n, None, "publication header: not JSON"),
        (renamed, n, None, "'model.nope' is not a parameter of this engine's model"),
        (reshaped, n, None, f"{params[0].name} has shape [{params[0].shape[0] + 1}, 64], the "
                            f"engine's model [{params[0].shape[0]}, 64]"),
        (good, n + 1, None, "header makes"),
        # a delta publication's block sizes, all checked before anything loads
        (good, n, [pd.DENSE, 7] * n, "publication bucket 0: kind 0 with 7 elements, the "
                                     "header says"),
        (good, n, [pd.SPARSE, 1] * n, "publication bucket 0: a sparse block in a full "
                                      "publication"),
    ]
    for header, nb, metas, want in cases:
        th = threading.Thread(target=_bad_publication, args=(pg, 5, header, nb, metas))
        th.start()
        res = receive_all(et, engines, Publish(version=5, path="", method="dist", n_buckets=nb,
                                               delta=metas is not None))
        th.join()
        for r in res:
            assert isinstance(r, Exception), res
            line = str(r).splitlines()[0] if str(r) else ""
            assert want in line, str(r)[:2000]
        assert digests(et, engines) == before, want
        assert all(e.version != 5 for e in engines)


def test_formation_is_tried_again_when_a_member_fails_one(capsys):
    """A member that misses a formation (here: it comes after the others timed out) makes
    every member try again under a fresh prefix; all agree on each outcome through the
    store, and the group forms on the next try."""
    store = pd.host_store("127.0.0.1", 0, 2, KEY)
    out = {}

    def member(rank, delay):
        time.sleep(delay)
        try:
            out[rank] = pd.join_group("127.0.0.1", store.port, rank, 2, token="late",
                                      timeout_s=2, key=KEY)
        except pd.PublishError as e:
            out[rank] = e
    threads = [threading.Thread(target=member, args=(0, 0.0)),
               threading.Thread(target=member, args=(1, 3.0))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not any(isinstance(v, Exception) for v in out.values()), out
    t = [torch.ones(2), torch.ones(2) * 2]
    works = [out[r].allreduce([t[r]]) for r in (0, 1)]
    for w in works:
        w.wait()
    assert t[0].tolist() == t[1].tolist() == [3.0, 3.0]
    log = capsys.readouterr().out
    assert "(rank 0 of 2): formation 1 of 3 failed" in log and "trying again" in log
    store.close()
