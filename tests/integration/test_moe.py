"""Qwen3-MoE <-> Megatron MoE layers: logits and grads against HF `Qwen3MoeForCausalLM`
(eager experts), export round trips, TP = 2 and EP = 2 on 2 gloo ranks (the FLOP ledger at
EP = 2 too), the learner at EP = 2 (lockstep replays), refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.dist_util import run_dist
from tests.helpers.moe_reference import by_disk_name
from tests.helpers.moe_shared import FP32_TOL  # noqa: F401  (shared with the unit tests)
from tests.helpers.paths import ROOT, WORKERS

WORKER = os.path.join(WORKERS, "moe_worker.py")


@pytest.fixture(scope="module")
def moe_launch(tiny_qwen3_moe, tmp_path_factory):
    """One 2-rank launch: TP=2 (EP=1), then TP=1 x EP=2 (the model's checks, then the FLOP
    ledger's), then moe_replays' jobs."""
    from tests.helpers.replay import job_results, write_jobs
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    odd = make_tiny_checkpoint(str(tmp_path_factory.mktemp("odd_experts")), arch="qwen3_moe",
                               experts=3, seed=5)
    d, jobs, data = replay_jobs(tiny_qwen3_moe, tmp_path_factory)
    cfg = {"ckpt": tiny_qwen3_moe, "odd_experts": odd, "replays": write_jobs(jobs, str(d)),
           "ledger_ep": {"ckpt": tiny_qwen3_moe, "shapes": [[1, 19], [2, 11]]}}
    ranks = run_dist([WORKER, json.dumps(cfg)], nproc=2, timeout=900)
    return dict(ranks=ranks, replays={**job_results(jobs, str(d), ranks[0]["summaries"]), **data})


@pytest.fixture(scope="module")
def dist_results(moe_launch):
    return moe_launch["ranks"]


def test_tp2_logits_and_export(dist_results):
    for r in dist_results:
        t = r["tp2"]
        assert t["tp_size"] == 2 and t["local_experts"] == 4
        assert t["fc1_rows"] == 32  # [gate; up] of 2 x 32 channels, half per TP rank
        assert t["logits_err"] <= FP32_TOL
        assert t["export_names_equal"] and t["export_exact"]


def test_ep2_logits_grads_and_export(dist_results):
    for r in dist_results:
        e = r["ep2"]
        assert e["dp_size"] == 2 and e["local_experts"] == 2  # 4 experts over 2 EP ranks
        assert e["experts_in_expert_buffers"]  # DDP reduces them over the expert-DP group
        assert e["logits_err"] <= FP32_TOL
        assert e["export_names_equal"] and e["export_exact"]  # gathered over EP
        assert e["grad_names_ok"] and e["grad_rel_err"] <= 1e-4  # both ranks' batches
        msg = e["odd_experts_error"]
        assert msg and "num_experts 3 must be divisible by ep 2" in msg


def test_ep_rank_flops_equal_counter_on_each_rank(dist_results, tiny_qwen3_moe):
    """The FLOP ledger at EP = 2 on 2 gloo ranks, a different batch on each, against
    FlopCounterMode: a rank runs attention, router and head on its own tokens and its 2
    experts on both ranks' tokens routed to them (the rest: tests/unit/test_ledger_moe.py)."""
    from tsync_mcore.observability.ledger import ep_rank_flops, load_spec, train_flops

    ranks = [r["ledger_ep"] for r in dist_results]
    spec = load_spec(tiny_qwen3_moe)
    assert [r["local_experts"] for r in ranks] == [2, 2]
    lens, routing = [r["seq_lens"] for r in ranks], [r["routing"] for r in ranks]
    for k, r in enumerate(ranks):
        b = ep_rank_flops(spec, lens, routing, k, attention=r["attention"])
        assert (b.forward, b.total) == (r["forward"], r["total"])
        # not the rank's own tokens through every expert: its experts' load is the group's
        assert b.total != train_flops(spec, lens[k], attention=r["attention"]).total
    # the group together executes the model FLOPs of all its sequences
    whole = train_flops(spec, lens[0] + lens[1], attention=ranks[0]["attention"])
    assert sum(r["total"] for r in ranks) == whole.total
    with pytest.raises(ValueError, match="one routing per EP rank"):
        ep_rank_flops(spec, lens, routing[:1], 0)


@pytest.fixture(scope="module")
def moe_replays(moe_launch):
    """GRPO (two updates) and OPD replays on the tiny MoE, 2 data-parallel ranks, in
    moe_launch's launch; GRPO also at EP = 2 over the same ranks, and both with routing
    replay."""
    return moe_launch["replays"]


def replay_jobs(tiny_qwen3_moe, tmp_path_factory):
    """moe_replays' jobs: (their directory, name → replay arguments, the batches' rows)."""
    from tests.helpers.batchgen import (
        with_routing,
        write_batches,
        write_opd_batches,
        write_rows,
    )

    d = tmp_path_factory.mktemp("moe_replay")
    batch, opd_batch = str(d / "batch.jsonl"), str(d / "opd.jsonl")
    rows = write_batches(batch, 256, n_updates=2, seed=3)
    opd_rows = write_opd_batches(opd_batch, 256, n_updates=1, seed=2, turns=4)
    # as a rollout recording its routing sends them (4 experts, top-2, 2 layers)
    routed = with_routing([r for r in rows if r["policy_version"] == 0], 2, 2, 4, seed=5)
    opd_routed = with_routing(opd_rows, 2, 2, 4, seed=6)
    write_rows(str(d / "routed.jsonl"), routed)
    write_rows(str(d / "opd_routed.jsonl"), opd_routed)
    rr = ["--batch", str(d / "routed.jsonl"), "--routing-replay", "rollout"]
    opd_rr = ["--batch", str(d / "opd_routed.jsonl"), "--objective", "opd",
              "--routing-replay", "rollout"]
    common = ["--model", tiny_qwen3_moe, "--lr", "1e-5", "--save-grads", "all"]
    grpo = ["--batch", batch]
    opd = ["--batch", opd_batch, "--objective", "opd"]
    jobs = {"sync": [*grpo, "--schedule", "sync"],
            "thundersync": [*grpo, "--schedule", "thundersync", "--k-open", "2"],
            "thundersync_balanced": [*grpo, "--schedule", "thundersync", "--k-open", "2",
                                     "--routing", "balanced"],
            "opd_sync": [*opd, "--schedule", "sync"],
            "opd_thundersync": [*opd, "--schedule", "thundersync"],
            "opd_retain": [*opd, "--schedule", "thundersync", "--opd-replay", "retain"],
            "rr_sync": [*rr, "--schedule", "sync"],
            "rr_thundersync": [*rr, "--schedule", "thundersync", "--k-open", "2"],
            "rr_opd_sync": [*opd_rr, "--schedule", "sync"],
            "rr_opd_thundersync": [*opd_rr, "--schedule", "thundersync"],
            "learner_opd": [*opd, "--schedule", "thundersync", "--routing-replay", "learner"]}
    # EP = 2 over the same 2 ranks (its groups re-created per job): whole-batch packs (the
    # default budget), one by one (dummy passes), small packs (both)
    ep = [*grpo, "--ep", "2", "--no-shared-prefix"]
    jobs.update({"ep2_sync": [*ep, "--schedule", "sync"],
                 "ep2_group_ready": [*ep, "--schedule", "group_ready",
                                     "--max-tokens-per-pass", "0"],
                 "ep2_packed": [*ep, "--schedule", "group_ready", "--max-tokens-per-pass", "64"]})
    # TP = 2 (DP 1): MoE layers without sequence parallelism (model/bridge/)
    jobs.update({"tp2_sync": [*grpo, "--schedule", "sync", "--tp", "2"],
                 "tp2_thundersync": [*grpo, "--schedule", "thundersync", "--k-open", "2",
                                     "--tp", "2"],
                 "tp2_opd_thundersync": [*opd, "--schedule", "thundersync", "--tp", "2"]})
    return d, {n: [*common, *f] for n, f in jobs.items()}, dict(
        rows=rows, opd_rows=opd_rows, routed=routed, opd_routed=opd_routed)


def test_grpo_replay_streams_the_sync_update(moe_replays, tiny_qwen3_moe):
    """thundersync == sync (≤ 1e-6) and both == an FP64 HF reference (≤ 1e-5), with
    grad.safetensors in the checkpoint's on-disk (per-expert) names."""
    from safetensors.torch import load_file

    from tests.helpers.reference import reference_grad, rel_l2
    from tsync_mcore.model import bridge

    def grad(name, k):
        return load_file(os.path.join(moe_replays[name]["dir"], f"grad_{k}.safetensors"))

    on_disk = sorted(bridge.load_hf_state_dict(tiny_qwen3_moe))
    for k in (0, 1):
        g_sync = grad("sync", k)
        assert sorted(g_sync) == on_disk
        for name in ("thundersync", "thundersync_balanced"):
            err = rel_l2(grad(name, k), g_sync)
            print(f"MoE {name} vs sync, update {k}: rel L2 = {err:.2e}")
            assert err <= 1e-6, (name, k)
    rows0 = [r for r in moe_replays["rows"] if r["policy_version"] == 0]
    ref = by_disk_name(reference_grad(tiny_qwen3_moe, rows0, "grpo"))
    for name in ("sync", "thundersync"):
        got = grad(name, 0)
        assert got.keys() == ref.keys()
        err = rel_l2(got, ref)
        print(f"MoE {name} vs FP64 HF reference: rel L2 = {err:.2e}")
        assert err <= 1e-5, name
    params = load_file(os.path.join(moe_replays["sync"]["dir"], "params.safetensors"))
    assert sorted(params) == on_disk


def test_ep2_replay_equals_ep1(moe_replays, tiny_qwen3_moe):
    """EP = 2 (lockstep passes, dummies where a rank has none): every update's gradient and
    the parameters == EP = 1 on the same ranks (≤ 1e-6), == the FP64 HF reference (≤ 1e-5);
    one by one, ranks serve different numbers of passes, so dummies ran."""
    from safetensors.torch import load_file

    from tests.helpers.reference import reference_grad, rel_l2
    from tsync_mcore.observability import trace

    def load(name, f):
        return load_file(os.path.join(moe_replays[name]["dir"], f))

    names = ("ep2_sync", "ep2_group_ready", "ep2_packed")
    for k in (0, 1):
        g_ep1 = load("sync", f"grad_{k}.safetensors")
        for name in names:
            err = rel_l2(load(name, f"grad_{k}.safetensors"), g_ep1)
            print(f"MoE {name} vs ep1 sync, update {k}: rel L2 = {err:.2e}")
            assert err <= 1e-6, (name, k)
    for name in names:
        assert rel_l2(load(name, "params.safetensors"), load("sync", "params.safetensors")) \
            <= 1e-6, name
    rows0 = [r for r in moe_replays["rows"] if r["policy_version"] == 0]
    ref = by_disk_name(reference_grad(tiny_qwen3_moe, rows0, "grpo"))
    err = rel_l2(load("ep2_group_ready", "grad_0.safetensors"), ref)
    print(f"MoE ep2_group_ready vs FP64 HF reference: rel L2 = {err:.2e}")
    assert err <= 1e-5
    for name in ("ep2_group_ready", "ep2_packed"):
        d = moe_replays[name]["dir"]
        records = [r for rank in (0, 1)
                   for r in trace.read(os.path.join(d, f"trace_rank{rank}.jsonl"))]
        assert sum(r.dummy_passes for r in records if isinstance(r, trace.UpdateRecord)), name
    assert any(r.pass_id for r in trace.sources(records))  # ep2_packed: packs ran


def test_ep2_over_four_ranks_reduces_experts_over_expert_dp(moe_replays, tiny_qwen3_moe,
                                                           tmp_path):
    """DP = 4, EP = 2: each expert on two ranks, its grads summed over that expert-DP pair
    (DDP and export_grad), lockstep over all four: == EP = 1 on 2 ranks (≤ 1e-6)."""
    from safetensors.torch import load_file

    from tests.helpers.reference import rel_l2
    from tests.helpers.replay import replay_many

    batch = os.path.join(os.path.dirname(moe_replays["sync"]["dir"]), "batch.jsonl")
    args = ["--model", tiny_qwen3_moe, "--batch", batch, "--lr",
            "1e-5", "--save-grads", "all", "--ep", "2", "--no-shared-prefix", "--schedule",
            "group_ready", "--max-tokens-per-pass", "64"]
    got = replay_many({"dp4_ep2": args}, str(tmp_path), nproc=4)["dp4_ep2"]
    assert (got["summary"]["dp"], got["summary"]["ep"]) == (4, 2)
    for k in (0, 1):
        err = rel_l2(load_file(os.path.join(got["dir"], f"grad_{k}.safetensors")),
                     load_file(os.path.join(moe_replays["sync"]["dir"],
                                            f"grad_{k}.safetensors")))
        print(f"MoE DP 4 x EP 2 vs EP 1, update {k}: rel L2 = {err:.2e}")
        assert err <= 1e-6, k


def test_opd_replay_streams_the_sync_update(moe_replays, tiny_qwen3_moe):
    """OPD per-turn streaming (recompute and retain) == sync (≤ 1e-6), and == the FP64
    Eq. 8-9 reference on HF's eager experts (≤ 1e-5)."""
    from safetensors.torch import load_file

    from tests.helpers.reference import reference_opd_grad, rel_l2

    def grad(name):
        return load_file(os.path.join(moe_replays[name]["dir"], "grad_0.safetensors"))

    g_sync = grad("opd_sync")
    for name in ("opd_thundersync", "opd_retain"):
        err = rel_l2(grad(name), g_sync)
        print(f"MoE {name} vs opd_sync: rel L2 = {err:.2e}")
        assert err <= 1e-6, name
    ref = by_disk_name(reference_opd_grad(tiny_qwen3_moe, moe_replays["opd_rows"]))
    for name in ("opd_sync", "opd_thundersync"):
        got = grad(name)
        assert got.keys() == ref.keys()
        err = rel_l2(got, ref)
        print(f"MoE {name} vs FP64 HF reference (Eq. 8-9): rel L2 = {err:.2e}")
        assert err <= 1e-5, name


def test_tp2_replays_equal_tp1(moe_replays):
    """MoE training at TP = 2 (no sequence parallelism: each TP rank routes the whole
    sequence, and the step takes the experts' tp-fold gradients back to one): GRPO sync and
    thundersync, OPD thundersync equal the TP = 1 runs (≤ 1e-6), and the reported grad norm
    is the gradient's own."""
    from safetensors.torch import load_file

    from tests.helpers.reference import rel_l2

    def grad(name, k=0):
        return load_file(os.path.join(moe_replays[name]["dir"], f"grad_{k}.safetensors"))

    for tp2, tp1, ks in (("tp2_sync", "sync", (0, 1)), ("tp2_thundersync", "sync", (0, 1)),
                         ("tp2_opd_thundersync", "opd_sync", (0,))):
        for k in ks:
            err = rel_l2(grad(tp2, k), grad(tp1, k))
            print(f"MoE {tp2} vs {tp1} (TP 1, DP 2), update {k}: rel L2 = {err:.2e}")
            assert err <= 1e-6, (tp2, k)
        g = grad(tp2, ks[-1])
        norm = sum(float((t.double() ** 2).sum()) for t in g.values()) ** 0.5
        assert abs(moe_replays[tp2]["summary"]["grad_norm"][-1] - norm) <= 1e-5 * norm


def _forced(model, row):
    """HF's forward of a replay row under the routing it carries (its last position,
    which scores nothing, takes the row before's experts)."""
    from tsync_mcore.model.tiny_moe import hf_forced_routing

    e = row["routed_experts"]
    return hf_forced_routing(model, torch.tensor(e + e[-1:]))


def test_rollout_routing_replay_streams_the_sync_update(moe_replays, tiny_qwen3_moe):
    """learner.routing_replay=rollout: GRPO and OPD sources carrying experts their routers
    would not pick (one group member's prompt routed apart from its group's); streamed ==
    sync (≤ 1e-6), both == the FP64 HF reference under the same forced routing (≤ 1e-5),
    and far from the learner's own routing."""
    from safetensors.torch import load_file

    from tests.helpers.reference import reference_grad, reference_opd_grad, rel_l2

    def grad(name):
        return load_file(os.path.join(moe_replays[name]["dir"], "grad_0.safetensors"))

    refs = {"rr": by_disk_name(reference_grad(tiny_qwen3_moe, moe_replays["routed"], "grpo",
                                              routing=_forced)),
            "rr_opd": by_disk_name(reference_opd_grad(tiny_qwen3_moe, moe_replays["opd_routed"],
                                                      routing=_forced))}
    for pre, own in (("rr", "sync"), ("rr_opd", "opd_sync")):
        g_sync = grad(f"{pre}_sync")
        err = rel_l2(grad(f"{pre}_thundersync"), g_sync)
        print(f"routing replay {pre}: thundersync vs sync rel L2 = {err:.2e}")
        assert err <= 1e-6
        for name in ("sync", "thundersync"):
            err = rel_l2(grad(f"{pre}_{name}"), refs[pre])
            print(f"routing replay {pre}_{name} vs FP64 HF reference, forced: {err:.2e}")
            assert err <= 1e-5
        assert rel_l2(g_sync, grad(own)) > 0.1  # the rollout's experts, not the learner's


def test_learner_routing_replay_equals_own_routing(moe_replays):
    """learner.routing_replay=learner (OPD: turns re-run in the recompute replay replay the
    experts of their first forward) is the learner's own routing: == sync, ≤ 1e-6."""
    from safetensors.torch import load_file

    from tests.helpers.reference import rel_l2

    def grad(name):
        return load_file(os.path.join(moe_replays[name]["dir"], "grad_0.safetensors"))

    err = rel_l2(grad("learner_opd"), grad("opd_sync"))
    print(f"routing replay learner (OPD thundersync) vs opd_sync: rel L2 = {err:.2e}")
    assert err <= 1e-6


def test_live_run_at_ep2_publishes_checkpoints_and_exports(tmp_path):
    """launch/run.py on the demo task with the vLLM-sized tiny MoE, 2 learner ranks at
    model.ep 2 (lockstep serving, group_ready) with learner routing replay: every update
    trains on θ_k, each rank's experts move, the checkpoint holds each rank's experts, and
    its HF export equals, bit for bit, the last weights published to vLLM (gathered over EP
    on the live ranks; the export renumbers each rank file's experts)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tsync_mcore.model.tiny import make_tiny_checkpoint
    from tsync_mcore.model.tiny_moe import VLLM_TINY_MOE
    from tsync_mcore.observability import trace

    root = ROOT
    model, run, pub = tmp_path / "model", tmp_path / "run", tmp_path / "publish"
    make_tiny_checkpoint(str(model), **VLLM_TINY_MOE)
    p = subprocess.run(
        [sys.executable, os.path.join(root, "launch/run.py"), "--config",
         os.path.join(root, "tsync_mcore/cli/demo.yaml"), "--set", f"run.dir={run}",
         f"model.hf_dir={model}", "run.updates=2", "rollout.groups_per_batch=4", "model.ep=2",
         "learner.schedule=group_ready", "learner.shared_prefix=false",
         "learner.routing_replay=learner", "publish.method=file", f"publish.dir={pub}"],
        cwd=root, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[config] rollout.routing: auto -> static (model.ep > 1" in p.stdout
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert all(r["stale_sources"] == 0 and r["trajectories"] == 16 for r in rows)
    for r in range(2):
        for e in trace.sources(trace.read(str(run / "traces" / f"rank{r}.jsonl"))):
            assert e.policy_version == e.update
    meta = json.load(open(run / "checkpoints" / "step_2" / "meta.json"))
    assert meta["ep"] == 2
    exported = {}
    for f in (run / "hf").glob("*.safetensors"):
        exported.update(load_file(str(f)))
    published = load_file(str(pub / "policy_v2.safetensors"))
    assert exported.keys() == published.keys()
    assert all(torch.equal(exported[k], published[k]) for k in published)
    init = load_file(str(next(model.glob("*.safetensors"))))
    for e in range(4):  # experts 0, 1 on EP rank 0; 2, 3 on EP rank 1
        k = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        assert not torch.equal(init[k], exported[k]), k
