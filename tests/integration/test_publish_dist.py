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


def open_group(et, engines, timeout_s=30.0, key=None, rank0_key=None):
    """A store here, learner rank 0 in a thread, the engines' workers as ranks 1, 2;
    `key`: the engines' group key, `rank0_key` rank 0's (default: the same)."""
    store = pd.host_store("127.0.0.1", 0, timeout_s)
    token, world, out = secrets.token_hex(8), 1 + len(engines), {}

    def rank0():
        try:
            out["pg"] = pd.join_group("127.0.0.1", store.port, 0, world, token=token,
                                      timeout_s=timeout_s, key=rank0_key or key)
        except pd.PublishError as e:
            out["error"] = e
    th = threading.Thread(target=rank0)
    th.start()

    async def join():
        return await asyncio.gather(*[e.join_publish_group(
            "127.0.0.1", store.port, 1 + i, world, token=token, timeout_s=timeout_s,
            key=key.hex() if key else "") for i, e in enumerate(engines)])

    try:
        assert et.run(join()) == [[1], [2]]
    finally:
        th.join()
    if "error" in out:
        raise out["error"]
    return out["pg"], (store, pd.Seal(store))  # sealed, as the rollout does once formed


def test_a_member_without_the_runs_secret_is_refused_before_any_weight(rig, ckpts):
    """The store is open to any local process and lists the group's token: one that joins
    as rank 0 first, without the run's secret, fails the handshake on every engine worker
    (named, one line) and no tensor is loaded; members holding the key form the group."""
    et, engines = rig
    before = digests(et, engines)
    key = pd.group_key(b"s" * 32, "t")
    with pytest.raises(Exception, match=r"rank\(s\) \[0\] did not prove the run's secret"):
        open_group(et, engines, timeout_s=20, key=key, rank0_key=pd.group_key(b"x" * 32, "t"))
    assert digests(et, engines) == before
    pg, (store, seal) = open_group(et, engines, timeout_s=20, key=key)
    assert pg is not None
    # formed: the store is emptied and kept empty, so an outsider lists nothing (not the
    # token) and a value it parks there is gone within the sweep period
    outsider = TCPStore("127.0.0.1", store.port, is_master=False,
                        timeout=datetime.timedelta(seconds=5))
    assert outsider.list_keys() == []
    outsider.set("flood", b"x" * (7 << 20))
    deadline = time.monotonic() + 5
    while outsider.list_keys() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outsider.list_keys() == [] and seal.deleted >= 1
    digests(et, engines)  # the engines go on


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
    store = pd.host_store("127.0.0.1", 0, 120)
    token = secrets.token_hex(8)
    out = {}
    th = threading.Thread(target=lambda: out.update(res=run_dist(
        [os.path.join(REPO_ROOT, "tests/helpers/workers/publish_worker.py"), ckpts[1], "2",
         "127.0.0.1", str(store.port), "3", token, str(BUCKET)], nproc=2, timeout=240)))
    th.start()

    async def join():
        return await asyncio.gather(*[e.join_publish_group(
            "127.0.0.1", store.port, 1 + i, 3, token=token, timeout_s=120)
            for i, e in enumerate(engines)])

    et.run(join())
    n = int(store.get("n_buckets"))  # the worker tells it through the store (the notice's)
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

    store = pd.host_store("127.0.0.1", 0, 10)
    pg = pd.join_group("127.0.0.1", store.port, 0, 1, token="solo", timeout_s=10)
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
