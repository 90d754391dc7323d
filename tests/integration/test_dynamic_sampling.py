"""DAPO dynamic sampling: `learner.filter_groups: zero_std` and the rollout's reserve groups.

In process: a batch with uniform groups (one of them with a KL and entropy term, whose
sums sit in the group's third vector) — the learner drops each at its close, whatever it
had folded into its open sums; thundersync (one by one and in packed pair passes) equals
sync, equals sync without the filter on the kept groups alone, and equals the FP64
reference on those; n_groups, N_k and the token norms count only what trains. The
rollout's side (rollout/oversample.py): reserves start one per filtered group and the
rest are dropped. Live: tests/integration/test_dynamic_sampling_live.py.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.batchgen import make_batch
from tests.helpers.off_policy import _hf
from tests.helpers.reference import rel_l2
from tests.helpers.in_process import as_sources, make_learner, run_update
from tests.helpers.regularized import VOCAB, reference_objective
from tsync_mcore.learner.update import FILTERED
from tsync_mcore.rollout.oversample import Oversampling


def _rows():
    """5 groups of 3; g0 (0.3 each) and g2 (1.0 each) uniform."""
    rows = make_batch(VOCAB, n_groups=5, m=3, version=0, seed=23)
    for r in rows:
        if r["group_id"].endswith("g2"):
            r["reward"] = 1.0
    return rows


@pytest.mark.parametrize("regularized", [False, True])
def test_filtered_groups_leave_the_update_exactly(tiny_qwen2, parallel1, tmp_path,
                                                  regularized):
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    rows = _rows()
    kept = [r for r in rows if not r["group_id"].endswith(("g0", "g2"))]
    reg = {}
    ref_model = None
    if regularized:
        ref_dir = str(tmp_path / "ref")
        make_tiny_checkpoint(ref_dir, arch="qwen2", seed=7)
        reg = dict(kl_coef=0.3, entropy_coef=0.05, reference=ref_dir)
        ref_model = _hf(ref_dir)
    runs = {"sync": (dict(schedule="sync", shared_prefix=False), 1, rows),
            "ts": (dict(schedule="thundersync", k_open=2), 1, rows),
            "ts_packed": (dict(schedule="thundersync", k_open=2), 4, rows),
            "sync_kept_only": (dict(schedule="sync", filter_groups="none"), 1, kept)}
    res = {}
    for name, (sched, chunk, batch) in runs.items():
        ln = make_learner(parallel1, tiny_qwen2, **{"filter_groups": "zero_std", **reg, **sched})
        res[name] = run_update(ln, as_sources(batch), chunk)
    ref = reference_objective(_hf(tiny_qwen2), ref_model, kept, kl_coef=reg.get("kl_coef", 0.0),
                              ent_coef=reg.get("entropy_coef", 0.0))
    errs = {k: rel_l2(r.grad, res["sync_kept_only"].grad) for k, r in res.items()}
    err_ref = max(rel_l2(r.grad, ref) for r in res.values())
    print(f"filter_groups (regularized {regularized}): vs sync on the kept groups "
          f"{max(errs.values()):.2e}, vs FP64 {err_ref:.2e}")
    assert max(errs.values()) <= 1e-6 and err_ref <= 1e-5
    n_kept = sum(sum(r["scored_mask"]) for r in kept)
    for name in ("sync", "ts", "ts_packed"):
        s = res[name].summary
        assert s.n_groups == 3 and s.scored_tokens == n_kept
        assert s.dropped_groups == {"v0-g0": FILTERED, "v0-g2": FILTERED}
    # the uniform groups really were folded into open sums before they were dropped
    early = [r for r in res["ts"].trace if getattr(r, "fold", None) == "pair"
             and r.group_id in ("v0-g0", "v0-g2")]
    assert early


def test_reserves_start_one_per_filtered_group_and_the_rest_are_dropped():
    groups = {f"g{i}": [f"g{i}-t0", f"g{i}-t1"] for i in range(5)}

    async def run():
        over = Oversampling(groups, needed=2)
        started = {g: asyncio.ensure_future(over.gate(g)) for g in groups}
        await asyncio.sleep(0)
        assert started["g0"].done() and started["g1"].done()
        assert not any(started[g].done() for g in ("g2", "g3", "g4"))
        for r in (1.0, 1.0):  # g0 uniform: one reserve starts
            over.member_done("g0", r)
        await asyncio.sleep(0)
        assert started["g2"].done() and started["g2"].result() is True
        assert not started["g3"].done()
        over.member_done("g1", 0.0)
        over.member_done("g1", 1.0)  # informative
        over.member_done("g2", 0.5)
        over.member_done("g2", None)  # a member that sent nothing: its group was dropped
        await asyncio.sleep(0)  # every started group ended: no reserve can start any more
        assert started["g3"].result() is False and started["g4"].result() is False
        assert over.unused() == ["g3", "g4"]
        assert over.metrics() == {"rollout/oversampled_groups": 1.0,
                                  "rollout/informative_groups": 1.0}
    asyncio.run(run())


def test_dynamic_sampling_refusals():
    from tsync_mcore.config import ConfigError, load_config
    for overrides, match in [
        ({"rollout.max_oversample": 2}, "set learner.filter_groups: zero_std"),
        ({"learner.filter_groups": "zero_std", "learner.objective": "opd"}, "OPD's turns"),
        ({"learner.filter_groups": "zero_std", "rollout.max_oversample": 2,
          "learner.schedule": "fully_async"}, "fully_async forms"),
        ({"reward.overlong_buffer": 500, "rollout.max_tokens_per_turn": 64,
          "rollout.max_turns": 3}, "must be < the response budget 192"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
