"""KL to a reference policy and the entropy bonus (objectives/regularizers.py), streamed.

Each term's gradient is fixed when its source arrives: thundersync (pair folds, shared
prompts, packed pair passes) equals sync, and both equal an independent FP64 reference
written per sequence on the Hugging Face model — the KL estimators from their formulas,
the entropy from the full softmax — alone and combined with masked IS; at TP = 1 in
process and TP = 2 through the replay command (one 2-rank launch, which also replays PPO
over 2 DP ranks); the LoRA reference is the base with the adapters off; OPD's entropy
bonus; the figures (actor/kl, reference bytes and tokens, the ledger's reference FLOPs)
and the refusals.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import make_batch
from tests.helpers.off_policy import _hf, _with_behaviour
from tests.helpers.in_process import as_sources, make_learner, run_update
from tests.helpers.reference import rel_l2
from tests.helpers.regularized import (CAP, LOW, VOCAB, kl_estimate, objective, ppo_objective,
                                      reference_objective)

@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    """A reference checkpoint of the same vocabulary that is not θ_0 (another seed), so
    every estimator's gradient is far from zero."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    out = str(tmp_path_factory.mktemp("reference") / "ref")
    make_tiny_checkpoint(out, arch="qwen2", seed=7)
    return out


def reference_opd_entropy(model, rows, ent_coef) -> dict:
    """∇ of J = (1/N_k) Σ_t [sg(log π_T − lp_t)·lp_t + η H_t] (OPD with the entropy bonus)."""
    n = sum(sum(r["scored_mask"]) for r in rows)
    J = torch.zeros((), dtype=torch.float64)
    for r in rows:
        at = [t for t in range(1, len(r["tokens"])) if r["scored_mask"][t]]
        if not at:
            continue
        ids = torch.tensor(r["tokens"])
        logsm = torch.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
        idx = torch.tensor(at) - 1
        lp = logsm[idx, ids[at]]
        teacher = torch.tensor([r["teacher_logprobs"][t] for t in at], dtype=torch.float64)
        ent = -(logsm[idx].exp() * logsm[idx]).sum(-1)
        J = J + (((teacher - lp).detach() * lp).sum() + ent_coef * ent.sum()) / n
    params = list(model.named_parameters())
    grads = torch.autograd.grad(J, [p for _, p in params], allow_unused=True)
    return {n_: (g if g is not None else torch.zeros_like(p)) for (n_, p), g in zip(params, grads)}


def _mean_kl(model, ref_model, rows, est) -> float:
    """The FP64 estimator's mean over every scored token (actor/kl)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for r in rows:
            at = [t for t in range(1, len(r["tokens"])) if r["scored_mask"][t]]
            if not at:
                continue
            ids = torch.tensor(r["tokens"])
            idx = torch.tensor(at) - 1
            lp = torch.log_softmax(model(ids[None]).logits[0, :-1], -1)[idx, ids[at]]
            ref = torch.log_softmax(ref_model(ids[None]).logits[0, :-1], -1)[idx, ids[at]]
            total += float(kl_estimate(lp - ref, est.rstrip("+")).sum())
            n += len(at)
    return total / n


# --- in process, TP = 1 --------------------------------------------------------------------

def _turns(rows):
    from tsync_mcore.channel.sources import opd_turns_from_json
    turns = [t for r in rows for t in opd_turns_from_json({k: v for k, v in r.items()
                                                           if k != "update"})]
    return sorted(turns, key=lambda t: t.ready_order)


# (name, kl_coef, estimator, entropy_coef, masked IS)
CASES = [("k1", 0.3, "k1", 0.0, False), ("k2", 0.3, "k2", 0.0, False),
         ("k3", 0.3, "k3", 0.0, False), ("k3+", 0.3, "k3+", 0.0, False),
         ("entropy", 0.0, "k3", 0.05, False), ("k3+entropy+mis", 0.3, "k3", 0.05, True)]


@pytest.fixture(scope="module")
def grpo_rows(tiny_qwen2):
    return _with_behaviour(_hf(tiny_qwen2), make_batch(VOCAB, n_groups=4, m=3, version=0,
                                                       seed=17), seed=5)


def test_kl_and_entropy_stream_exactly_and_match_the_fp64_reference(
        tiny_qwen2, ref_dir, parallel1, grpo_rows):
    """Every case on three learners: sync (direct folds, one packed pass), thundersync one
    by one (k_open 1: pair folds, shared prompts) and thundersync handed 4 sources at a time
    (packed pair passes). The FP64 reference gives the k+ estimators k2's gradient."""
    from tsync_mcore.objectives.off_policy import OffPolicy
    from tsync_mcore.objectives.regularizers import Regularizer
    base = dict(kl_coef=0.3, reference=ref_dir, entropy_coef=0.05)
    learners = {"sync": (make_learner(parallel1, tiny_qwen2, schedule="sync", shared_prefix=False,
                                  **base), 1),
                "ts": (make_learner(parallel1, tiny_qwen2, schedule="thundersync", k_open=1,
                                **base), 1),
                "ts_packed": (make_learner(parallel1, tiny_qwen2, schedule="thundersync",
                                       k_open=2, **base), 4)}
    model, ref_model = _hf(tiny_qwen2), _hf(ref_dir)
    for k, (name, beta, est, eta, mis) in enumerate(CASES):
        srcs = as_sources(grpo_rows, version=k)
        res = {}
        for lname, (ln, chunk) in learners.items():
            ln.reg = Regularizer(beta, est, eta)
            ln.off_policy = OffPolicy("mis" if mis else "none", CAP, ln.policy.device, low=LOW)
            res[lname] = run_update(ln, srcs, chunk)
        grad_est = "k2" if est.endswith("+") else est
        ref = reference_objective(model, ref_model, grpo_rows, kl_coef=beta, est=grad_est,
                                  ent_coef=eta, guard=(LOW, CAP) if mis else None)
        errs = {k: rel_l2(r.grad, res["sync"].grad) for k, r in res.items() if k != "sync"}
        err_ref = max(rel_l2(r.grad, ref) for r in res.values())
        print(f"{name}: thundersync vs sync {max(errs.values()):.2e}, vs FP64 {err_ref:.2e}, "
              f"actor/kl {res['ts'].summary.kl_mean}")
        assert max(errs.values()) <= 1e-6 and err_ref <= 1e-5, (name, errs, err_ref)
        if beta:
            want = _mean_kl(model, ref_model, grpo_rows, est)
            assert all(r.summary.kl_mean == pytest.approx(want, rel=1e-5) for r in res.values())
        else:
            assert res["ts"].summary.kl_mean is None
    # the streamed paths really ran: pair folds one by one and in packed pair passes
    trace = res["ts"].trace + res["ts_packed"].trace
    assert any(getattr(r, "fold", None) == "pair" and r.pass_id is None for r in trace)
    assert any(getattr(r, "fold", None) == "pair" and r.pass_id is not None
               for r in res["ts_packed"].trace)
    # what the reference cost: its weights, and every scored source's tokens forwarded once
    s = res["ts"].summary
    n_params = sum(p.numel() for p in ref_model.parameters())
    assert s.reference_bytes == 4 * n_params
    served = [r for r in res["ts"].trace if getattr(r, "kind", "") == "source" and r.served]
    assert all(r.reference_tokens == (len(next(x for x in srcs if x.traj_id == r.traj_id).tokens)
                                      if r.scored_tokens else 0) for r in served)


def test_ledger_counts_the_reference_forward(tiny_qwen2):
    """A source's reference_tokens add one forward of those tokens, no backward."""
    from dataclasses import replace

    from tsync_mcore.model.bridge.spec import load_hf_config
    from tsync_mcore.observability.ledger.account import update_flops
    from tsync_mcore.observability.ledger.flops import span_flops
    from tsync_mcore.observability.trace import SourceRecord
    spec = load_hf_config(tiny_qwen2)
    rec = SourceRecord(update=0, rank=0, source="trajectory", traj_id="t", group_id="g",
                       turn=None, policy_version=0, scored_tokens=5, ready=0.0, start=0.0,
                       end=1.0, span_tokens=12, logits=True)
    plain = update_flops(spec, [rec])
    with_ref = update_flops(spec, [replace(rec, reference_tokens=12)])
    fwd = span_flops(spec, 12, 0).forward
    assert with_ref.forward - plain.forward == pytest.approx(fwd)
    assert with_ref.backward == plain.backward


def test_lora_reference_is_the_base_with_the_adapters_off(tiny_qwen2, parallel1, grpo_rows,
                                                          tmp_path):
    """LoRA with reference 'initial': no second copy (reference_bytes 0), and the KL term's
    log π_ref is the base model's: the adapters' gradient equals the FP64 HF + peft
    reference whose π_ref is a separately loaded base model; thundersync equals sync."""
    from tests.helpers.lora_reference import adapter_grad, load_peft_model, make_peft_adapter
    ad = make_peft_adapter(tiny_qwen2, str(tmp_path / "adapter"), seed=3)
    lora = {"model.lora_init": ad}
    kw = dict(kl_coef=0.5, kl_estimator="low_var_kl", entropy_coef=0.05, model=lora)
    res = {name: run_update(make_learner(parallel1, tiny_qwen2, **sched, **kw), as_sources(grpo_rows))
           for name, sched in [("sync", dict(schedule="sync", shared_prefix=False)),
                               ("ts", dict(schedule="thundersync", k_open=1))]}
    peft_model = load_peft_model(tiny_qwen2, ad)
    base = _hf(tiny_qwen2)
    # the FP64 objective on the peft model, its π_ref the separately loaded base
    J = objective(peft_model, base, grpo_rows, kl_coef=0.5, est="k3", ent_coef=0.05)
    ref = adapter_grad(peft_model, J)
    err_sync, err_ref = rel_l2(res["ts"].grad, res["sync"].grad), rel_l2(res["ts"].grad, ref)
    print(f"LoRA, reference = base: thundersync vs sync {err_sync:.2e}, vs FP64 HF + peft "
          f"{err_ref:.2e}, actor/kl {res['ts'].summary.kl_mean:.4f}")
    assert err_sync <= 1e-6 and err_ref <= 1e-5
    assert res["ts"].summary.reference_bytes == 0 and res["ts"].summary.kl_mean > 1e-4


def test_opd_entropy_bonus_streams_exactly(tiny_qwen2, parallel1):
    """OPD turns with the entropy bonus (weight 1, token_mean's 1/N_k at close): thundersync
    (turns as they come, context replay) equals sync and the FP64 whole-sequence reference."""
    from tests.helpers.batchgen import action_first, make_opd_batch
    rows = action_first(make_opd_batch(VOCAB, n_traj=4, turns=3, version=0, seed=4))
    res = {name: run_update(make_learner(parallel1, tiny_qwen2, objective="opd", entropy_coef=0.1,
                                  schedule=name), _turns(rows))
           for name in ("sync", "thundersync")}
    ref = reference_opd_entropy(_hf(tiny_qwen2), rows, 0.1)
    err_sync = rel_l2(res["thundersync"].grad, res["sync"].grad)
    err_ref = rel_l2(res["thundersync"].grad, ref)
    print(f"OPD + entropy: thundersync vs sync {err_sync:.2e}, vs FP64 {err_ref:.2e}")
    assert err_sync <= 1e-6 and err_ref <= 1e-5


# --- 2 ranks through the replay command: TP = 2, and PPO over 2 DP ranks ----------------

@pytest.fixture(scope="module")
def two_rank_replays(tiny_qwen2, ref_dir, grpo_rows, tmp_path_factory):
    """One launch of 2 ranks for every replay below (each job its own Policy and Learner,
    see replay_many): the TP = 2 jobs and PPO's mini-batches over 2 DP ranks (tp 1).
    Returns (runs, adapter dir, OPD rows, kept rows of the filtered batch)."""
    import json

    from tests.helpers.batchgen import action_first, make_opd_batch
    from tests.helpers.lora_reference import make_peft_adapter
    from tests.helpers.replay import replay_many
    tmp_path = tmp_path_factory.mktemp("two_ranks")
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps(dict(r, update=0)) + "\n" for r in grpo_rows))
    opd_rows = action_first(make_opd_batch(VOCAB, n_traj=4, turns=3, version=0, seed=4))
    opd = tmp_path / "opd.jsonl"
    opd.write_text("".join(json.dumps(dict(r, update=0)) + "\n" for r in opd_rows))
    ad = make_peft_adapter(tiny_qwen2, str(tmp_path / "adapter"), seed=3)
    configs = {"full": f"learner:\n  kl_coef: 0.3\n  kl_estimator: low_var_kl\n"
                       f"  entropy_coef: 0.05\n  reference: {ref_dir}\n  is_correction: mis\n"
                       f"  is_low: {LOW}\n  is_cap: {CAP}\n",
               "lora": "learner:\n  kl_coef: 0.5\n  entropy_coef: 0.05\n",
               "opd": "learner:\n  entropy_coef: 0.1\n",
               "filter": "learner:\n  filter_groups: zero_std\n  kl_coef: 0.3\n"
                         f"  reference: {ref_dir}\n",
               "ppo": "learner:\n  minibatches: 2\n  clip_high: 0.28\n  clip_dual: 1.05\n"
                      "  entropy_coef: 0.05\noptim:\n  eps: 1.0\n"}
    # dynamic sampling's batch: two uniform groups, dropped at their close
    uniform = [dict(r, reward=1.0 if r["group_id"].endswith("g2") else r["reward"])
               for r in make_batch(VOCAB, n_groups=5, m=3, version=0, seed=23)]
    filtered = tmp_path / "filter.jsonl"
    filtered.write_text("".join(json.dumps(dict(r, update=0)) + "\n" for r in uniform))
    kept = [r for r in uniform if not r["group_id"].endswith(("g0", "g2"))]
    jobs = {}
    for name, text in configs.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        common = ["--model", tiny_qwen2, "--tp", "2", "--config", str(tmp_path / f"{name}.yaml"),
                  "--lr", "1.0" if name == "ppo" else "1e-5", "--save-grads", "all",
                  "--batch", str({"opd": opd, "filter": filtered}.get(name, batch))]
        common += {"lora": ["--lora-adapter", ad], "opd": ["--objective", "opd"]}.get(name, [])
        jobs[f"{name}_sync"] = [*common, "--schedule", "sync"]
        jobs[f"{name}_ts"] = [*common, "--schedule", "thundersync", "--k-open", "1"]
    # PPO over 2 DP ranks (test_two_dp_ranks_balanced_routing_replay)
    dp_batch = tmp_path / "dp2.jsonl"
    dp_batch.write_text("".join(json.dumps(dict(r, update=0)) + "\n"
                                for r in make_batch(VOCAB, n_groups=4, m=3, version=0, seed=29)))
    (tmp_path / "dp2_ppo.yaml").write_text(
        "learner:\n  minibatches: 2\n  clip_high: 0.28\noptim:\n  eps: 1.0\n")
    common = ["--model", tiny_qwen2, "--batch", str(dp_batch), "--config",
              str(tmp_path / "dp2_ppo.yaml"), "--lr", "1.0", "--save-grads", "all"]
    jobs["dp2_sync"] = [*common, "--schedule", "sync"]
    jobs["dp2_balanced"] = [*common, "--routing", "balanced", "--k-open", "1"]
    return replay_many(jobs, str(tmp_path), nproc=2), ad, opd_rows, kept


def test_tp2_replay_streams_kl_entropy_and_mis_exactly(tiny_qwen2, ref_dir, grpo_rows,
                                                       two_rank_replays):
    """At TP = 2 (vocab-parallel log-probs, entropies and reference), one launch: KL k3
    (configured by verl's name) + entropy + masked IS; LoRA with the base as reference;
    OPD with the entropy bonus; dynamic sampling (two uniform groups) with KL; two PPO
    mini-batches with clip-higher, a binding dual clip and entropy. Each: thundersync equals sync and its FP64 reference; each
    TP rank holds half the reference's weights (none with LoRA)."""
    from tests.helpers.lora_reference import adapter_grad, load_peft_model
    runs, ad, opd_rows, kept = two_rank_replays
    runs = {n: r for n, r in runs.items() if not n.startswith("dp2_")}
    grads = {n: load_file(os.path.join(r["dir"], "grad.safetensors")) for n, r in runs.items()}
    model, ref_model = _hf(tiny_qwen2), _hf(ref_dir)
    peft_model = load_peft_model(tiny_qwen2, ad)
    refs = {"full": reference_objective(model, ref_model, grpo_rows, kl_coef=0.3, est="k3",
                                        ent_coef=0.05, guard=(LOW, CAP)),
            "lora": adapter_grad(peft_model, objective(
                peft_model, model, grpo_rows, kl_coef=0.5, est="k3", ent_coef=0.05)),
            "opd": reference_opd_entropy(_hf(tiny_qwen2), opd_rows, 0.1),
            "filter": reference_objective(model, ref_model, kept, kl_coef=0.3)}
    # PPO, two mini-batches: step 1 streamed; step 2 at the θ step 1 left (each run's own)
    from tsync_mcore.channel.sources import BatchPlan
    from tsync_mcore.learner.minibatch import split
    parts = split(BatchPlan.from_sources(as_sources(grpo_rows)), 2)
    clip = (0.2, 0.28, 1.05)
    refs["ppo"] = ppo_objective(model, model, None, [r for r in grpo_rows if r["group_id"]
                                                  in parts[0]], clip=clip, ent=0.05)
    for run in ("ppo_sync", "ppo_ts"):
        at = _hf(tiny_qwen2)
        at.load_state_dict({k: v.double() for k, v in load_file(os.path.join(
            runs[run]["dir"], "params_0_mb1.safetensors")).items()}, strict=False)
        want = ppo_objective(at, model, None, [r for r in grpo_rows if r["group_id"] in parts[1]],
                          clip=clip, ent=0.05)
        got = load_file(os.path.join(runs[run]["dir"], "grad_0_mb2.safetensors"))
        err = rel_l2(got, want)
        print(f"TP=2 ppo mini-batch 2 ({run}) vs FP64 at its θ: {err:.2e}")
        assert err <= 1e-5
    err = rel_l2(load_file(os.path.join(runs["ppo_ts"]["dir"], "grad_0_mb2.safetensors")),
                 load_file(os.path.join(runs["ppo_sync"]["dir"], "grad_0_mb2.safetensors")))
    print(f"TP=2 ppo mini-batch 2: thundersync vs sync {err:.2e}")
    assert err <= 1e-5  # its θ carries step 1's FP32 rounding (test_ppo_minibatches.py)
    assert runs["ppo_ts"]["summary"]["pg_clipfrac_lower"][0] > 0
    for name, ref in refs.items():
        err_sync = rel_l2(grads[f"{name}_ts"], grads[f"{name}_sync"])
        err_ref = rel_l2(grads[f"{name}_ts"], ref)
        print(f"TP=2 {name}: thundersync vs sync {err_sync:.2e}, vs FP64 {err_ref:.2e}")
        assert err_sync <= 1e-6 and err_ref <= 1e-5, name
    s = runs["full_ts"]["summary"]
    assert s["tp"] == 2 and s["kl_mean"][0] == pytest.approx(
        _mean_kl(model, ref_model, grpo_rows, "k3"), rel=1e-5)
    n_params = sum(p.numel() for p in ref_model.parameters())
    assert 4 * n_params / 2 < s["reference_bytes_per_rank"][0] < 4 * n_params
    assert runs["lora_ts"]["summary"]["reference_bytes_per_rank"] == [0, 0]
    assert runs["filter_ts"]["summary"]["scored_tokens"] == [
        sum(sum(r["scored_mask"]) for r in kept)]


def test_two_dp_ranks_balanced_routing_replay(tiny_qwen2, two_rank_replays):
    """PPO mini-batches (test_ppo_minibatches.py) over 2 DP ranks through the replay
    command: balanced routing (a later mini-batch's group split over the ranks, its rewards
    announced) streamed equals static routing under sync, step by step, θ between the steps
    included."""
    runs = two_rank_replays[0]
    theta0 = load_file(os.path.join(tiny_qwen2, "model.safetensors"))
    for name, tol in (("grad_0", 1e-6), ("grad_0_mb2", 1e-5), ("params_0_mb1", 1e-6),
                      ("params", 1e-6)):
        a, b = (load_file(os.path.join(runs[r]["dir"], f"{name}.safetensors"))
                for r in ("dp2_balanced", "dp2_sync"))
        if name.startswith("grad"):  # step 2's carries step 1's rounding
            err = rel_l2(a, b)
        else:  # θ: the gap relative to how far sync moved it
            gap = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b)
            moved = sum(float(((b[k].double() - theta0[k].double()) ** 2).sum()) for k in b)
            err = (gap / moved) ** 0.5
        print(f"2 DP ranks, balanced thundersync vs static sync, {name}: {err:.2e}")
        assert err <= tol, name
    s = runs["dp2_balanced"]["summary"]
    assert s["minibatch_steps"] == [2] and s["pg_clipfrac"][0] > 0
    assert runs["dp2_balanced"]["summary"]["dp"] == 2 and runs["dp2_sync"]["summary"]["tp"] == 1


# --- the reference's refresh and what is refused -----------------------------------------

def test_reference_refresh_copies_theta_every_n_updates(tiny_qwen2, parallel1, grpo_rows):
    """reference_update_every 2: after update 1 the reference is still θ_0; after update 2
    it is θ_2, parameter for parameter."""
    from tsync_mcore.model import bridge
    ln = make_learner(parallel1, tiny_qwen2, kl_coef=0.1, reference_update_every=2, lr=1e-3,
                  schedule="sync")

    def same() -> bool:
        theta = dict(bridge.unwrap(ln.policy.model).named_parameters())
        return all(torch.equal(p, theta[n])
                   for n, p in bridge.unwrap(ln.reference.model).named_parameters())
    assert same()  # θ_0 = model.hf_dir
    run_update(ln, as_sources(grpo_rows, 0))
    assert not same()
    run_update(ln, as_sources(grpo_rows, 1))
    assert same()


@pytest.mark.parametrize("overrides,match", [
    ({"learner.kl_estimator": "k4"}, "learner.kl_estimator"),
    ({"learner.kl_coef": -0.1}, "'learner.kl_coef': must be a finite number"),
    ({"learner.entropy_coef": float("nan")}, "learner.entropy_coef"),
    ({"learner.kl_coef": 0.1, "learner.objective": "opd"}, "log-ratio to the teacher"),
    ({"learner.kl_coef": 0.1, "model.lora.rank": 4, "learner.reference_update_every": 2},
     "not refreshed from θ"),
    ({"learner.kl_coef": 0.1, "learner.reference": "/nonexistent/ref"}, "is not 'initial'"),
])
def test_refusals(overrides, match):
    from tsync_mcore.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_verl_names_map_to_the_estimators():
    from tsync_mcore.config import load_config
    for verl, ours in (("low_var_kl", "k3"), ("mse", "k2"), ("kl", "k1"), ("k3+", "k3+")):
        cfg = load_config(None, {"learner.kl_coef": 0.1, "learner.kl_estimator": verl})
        assert cfg.learner.kl_estimator == ours


def test_reference_of_another_vocabulary_is_refused(tiny_qwen2, parallel1, tmp_path):
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    other = make_tiny_checkpoint(str(tmp_path / "v512"), arch="qwen2", vocab_size=512) or \
        str(tmp_path / "v512")
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the policy's has 256"):
        make_learner(parallel1, tiny_qwen2, kl_coef=0.1, reference=other)
