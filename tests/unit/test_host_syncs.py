"""No host stalls on the hot path: synchronising calls per served source, counted.

The learner serves a batch (GRPO and OPD; sync, group_ready, thundersync; shared prompts on
and off; behaviour log-probs with TIS, so the off-policy weights run too) under
`ledger.host.HostCounter`, and no served source may make more synchronising calls than
docs/design/learner.md documents. The counter itself is checked against calls it must see (a
deliberate `.item()` on the serving path among them) and calls it must not.
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

from tests.helpers.batchgen import make_batch, make_opd_batch
from tests.helpers.paths import ROOT
from tsync_mcore.observability.ledger.host import HostCounter
from tsync_mcore.platform import upload

VOCAB = 256


def documented_syncs() -> int:
    """The number docs/design/learner.md states (the test fails above it)."""
    with open(os.path.join(ROOT, "docs", "design", "learner.md")) as f:
        m = re.search(r"synchronising calls per served source: \*\*(\d+)\*\*", f.read(), re.I)
    assert m, "docs/design/learner.md no longer states the synchronising calls per served source"
    return int(m.group(1))


# --- the counter --------------------------------------------------------------------------

def _counted(fn) -> int:
    with HostCounter() as hc, hc.section("x"):
        fn()
    return hc.sections["x"].syncs


def _attempt(fn):
    """A CUDA call on a machine without CUDA raises (unless the CPU platform made it a
    no-op): the counter has counted it by then."""
    try:
        fn()
    except (AssertionError, RuntimeError):
        pass


x = torch.randn(6, dtype=torch.float64)
SYNCING = {
    "item": lambda: x.sum().item(),
    "float": lambda: float(x.sum()),
    "int": lambda: int(x.argmax()),
    "bool": lambda: bool((x > 0).any()),
    "if tensor": lambda: 1 if x.sum() > 0 else 0,
    "format": lambda: f"{x.sum():.3f}",
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "cpu": lambda: x.cpu(),
    "to(device)": lambda: x.to(x.device),
    "tensor(device=)": lambda: torch.tensor([1, 2], device=x.device),
    "nonzero": lambda: torch.nonzero(x > 0),
    "where(cond)": lambda: torch.where(x > 0),
    "mask index": lambda: x[x > 0],
    "mask assign": lambda: x.clone().__setitem__(x > 0, 0.0),
    "masked_select": lambda: torch.masked_select(x, x > 0),
    "unique": lambda: torch.unique(x),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: torch.allclose(x, x),
    "cuda.synchronize": lambda: _attempt(torch.cuda.synchronize),
}
QUIET = {
    "device math": lambda: (x * 2).sum().exp(),
    "long index": lambda: x[torch.arange(3)],
    "dtype cast": lambda: x.to(torch.float32),
    "host tensor": lambda: torch.tensor([1.0, 2.0]),
    "upload": lambda: upload([1, 2, 3], torch.long, x.device),
    "repeat_interleave(output_size)": lambda: torch.repeat_interleave(
        x[:2], torch.tensor([1, 2]), output_size=3),
    "masked_fill": lambda: x.masked_fill(x > 0, 0.0),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_counter_sees_synchronising_calls(name):
    assert _counted(SYNCING[name]) == 1


@pytest.mark.parametrize("name", sorted(QUIET))
def test_counter_leaves_device_work_alone(name):
    assert _counted(QUIET[name]) == 0


def test_counter_restores_what_it_intercepts():
    before = (torch.Tensor.__dict__.get("tolist"), torch.tensor, torch.as_tensor)
    with HostCounter():
        assert torch.tensor is not before[1]
    assert (torch.Tensor.__dict__.get("tolist"), torch.tensor, torch.as_tensor) == before
    with HostCounter() as hc:  # outside any section: charged to "outside"
        x.tolist()
    assert hc.sections["outside"].syncs == 1 and hc.sections["outside"].ops == 0


# --- the learner ----------------------------------------------------------------------------

def _learner(hf_dir, par, **learner):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-5,
                             **{f"learner.{k}": v for k, v in learner.items()}})
    return Learner(cfg.learner, Policy(cfg, par=par))


def _behaviour(mask, rng):
    return [-rng.uniform(0.1, 4.0) if m else None for m in mask]


def _sources(objective: str, version: int):
    """One batch of the objective's sources in arrival order, with behaviour log-probs."""
    from tsync_mcore.channel.sources import TrajectorySource, opd_turns_from_json
    rng = random.Random(version)
    if objective == "grpo":
        rows = sorted(make_batch(VOCAB, n_groups=3, m=3, seed=5, version=version),
                      key=lambda r: r["ready_order"])
        return [TrajectorySource.from_json(dict(r, behaviour_logprobs=_behaviour(
            r["scored_mask"], rng))) for r in rows]
    rows = make_opd_batch(VOCAB, n_traj=4, turns=3, seed=5, version=version)
    turns = [t for r in rows for t in opd_turns_from_json(
        dict(r, behaviour_logprobs=_behaviour(r["scored_mask"], rng)))]
    return sorted(turns, key=lambda t: t.ready_order)


def serve_batch(learner, counter: HostCounter | None = None, sources: bool = False):
    """One update through the learner's public entry points, counted when asked; with
    `sources`, (result, the sources served)."""
    from tsync_mcore.channel.sources import BatchPlan
    srcs = _sources(learner.cfg.objective, learner.version)
    watch = counter.watch(learner) if counter is not None else None
    if watch is not None:
        watch.__enter__()
    try:
        learner.begin(BatchPlan.from_sources(srcs))
        for s in srcs:
            # GRPO: each source served as it arrives (one per pass); OPD: every turn first
            learner.submit(s, serve=learner.cfg.objective == "grpo")
        res = learner.close()
        return (res, srcs) if sources else res
    finally:
        if watch is not None:
            watch.__exit__(None, None, None)


CASES = [
    ("grpo", "sync", True), ("grpo", "sync", False),
    ("grpo", "group_ready", True),
    ("grpo", "thundersync", True), ("grpo", "thundersync", False),
    ("opd", "sync", True), ("opd", "sync", False),
    ("opd", "thundersync", True), ("opd", "thundersync", False),
]


@pytest.mark.parametrize("objective,schedule,shared_prefix", CASES)
def test_served_sources_make_no_more_syncs_than_documented(tiny_qwen2, parallel1, objective,
                                                           schedule, shared_prefix):
    learner = _learner(tiny_qwen2, parallel1, objective=objective, schedule=schedule,
                       shared_prefix=shared_prefix, is_correction="tis")
    serve_batch(learner)  # warm-up: first-use work (lazy state, megatron's RoPE move)
    # on CUDA also torch's own sync warnings, as a cross-check (a no-op on the CPU)
    with HostCounter(cuda_sync_debug=True) as hc:
        res = serve_batch(learner, hc)
    assert res.summary.ok and res.summary.mismatch_tokens > 0  # the TIS path ran
    per = hc.per_source()
    sites = hc.sync_sites()
    print(f"{objective} {schedule} shared_prefix={shared_prefix}: {per}")
    assert per["sources"] == res.summary.n_sources > 0
    assert per["ops"] > 0 and per["host_us"] > 0
    limit = documented_syncs()
    worst = max(hc.units, key=lambda u: u.tally.syncs)
    assert worst.tally.syncs <= limit, (
        f"unit {worst.key!r} made {worst.tally.syncs} synchronising calls (documented: "
        f"{limit} per served source); on the serving path: {dict(sites)}")
    # submit's own work (validation, admission) outside serve_pass is per source too
    assert hc.sections["submit"].syncs == 0, dict(hc.sync_sites(("submit",)))
    assert max(u.tally.cuda_syncs for u in hc.units) <= limit


def test_the_count_fails_on_a_sync_in_the_serving_path(tiny_qwen2, parallel1):
    """A deliberate `.item()` per scored log-prob, and the opt-in per-source finiteness
    check: the counter attributes both to the sources that made them."""
    learner = _learner(tiny_qwen2, parallel1, objective="grpo", schedule="thundersync")
    serve_batch(learner)
    scored = learner.policy.scored_logprob

    def stalling(*args, **kwargs):
        logp = scored(*args, **kwargs)
        logp.sum().item()  # what a per-source log line of the loss would do
        return logp

    learner.policy.scored_logprob = stalling
    try:
        with HostCounter() as hc:
            _, srcs = serve_batch(learner, hc, sources=True)
    finally:
        del learner.policy.scored_logprob
    n_scored = {s.key: s.n_scored for s in srcs}
    served = [u for u in hc.units if u.key is not None]
    assert [u.tally.syncs for u in served] == [int(n_scored[u.key] > 0) for u in served]
    assert sum(u.tally.syncs for u in served) > documented_syncs() * len(served)
    assert list(hc.sync_sites()) == [f"aten._local_scalar_dense at test_host_syncs.py:"
                                     f"{stalling.__code__.co_firstlineno + 2}"]

    # learner.check_finite: source reads one finiteness flag per unit (documented opt-in)
    checked = _learner(tiny_qwen2, parallel1, objective="grpo", schedule="thundersync",
                       check_finite="source")
    serve_batch(checked)
    with HostCounter() as hc:
        serve_batch(checked, hc)
    served = [u for u in hc.units if u.key is not None]
    assert all(1 <= u.tally.syncs <= 2 for u in served)  # 2: its group's close came with it
    assert all(s.startswith("aten._local_scalar_dense at tsync_mcore/learner/policy.py:")
               for s in hc.sync_sites())
