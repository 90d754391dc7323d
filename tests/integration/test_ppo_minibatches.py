"""PPO mini-batch steps (`learner.minibatches`, objectives/ppo.py, learner/minibatch.py).

m = 2 with clip-higher, and m = 4 with clip-higher, a dual clip that binds, KL k3 +
entropy and masked IS: thundersync (mini-batch 1 streamed one by one and in packed pair
passes) ends the update at sync's θ, its streamed step's gradient is sync's, and every
step's gradient is the FP64 reference's — the clipped surrogate written out on the
Hugging Face model at the θ the learner's previous step left (the update reports θ
before each later step), old log-probs from θ_k. At a real
learning rate the ratios leave the clip range, so the clips act. Over 2 DP ranks and at
TP = 2 through the replay command: test_regularizers.py (one 2-rank launch for both).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.batchgen import make_batch
from tests.helpers.off_policy import _hf, _with_behaviour
from tests.helpers.reference import rel_l2
from tests.helpers.in_process import as_sources, make_learner, run_update
from tests.helpers.regularized import CAP, LOW, VOCAB, ppo_objective

LR = 1.0
OPTIM = {"optim.eps": 1.0}  # Adam ≈ SGD (lr·g/(|g|+1)): θ carries no amplified rounding


# (name, minibatches, clip (low, high, dual), KL k3 β, entropy η, masked IS)
CASES = [("m2_clip_higher", 2, (0.2, 0.28, 3.0), 0.0, 0.0, False),
         ("m4_dual_kl_entropy_mis", 4, (0.2, 0.28, 1.05), 0.3, 0.05, True)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_minibatch_steps_stream_exactly_and_match_the_fp64_reference(
        tiny_qwen2, parallel1, tmp_path, case):
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    from tsync_mcore.objectives.ppo import Clip
    name, m, clip, beta, eta, mis = case
    model0 = _hf(tiny_qwen2)
    rows = _with_behaviour(model0, make_batch(VOCAB, n_groups=4, m=3, version=0, seed=17),
                           seed=5)
    ref_dir = None
    kw = dict(minibatches=m, clip_low=clip[0], clip_high=clip[1], clip_dual=clip[2], lr=LR,
              model=OPTIM)
    if beta:
        ref_dir = str(tmp_path / "ref")
        make_tiny_checkpoint(ref_dir, arch="qwen2", seed=7)
        kw.update(kl_coef=beta, entropy_coef=eta, reference=ref_dir)
    if mis:
        kw.update(is_correction="mis", is_low=LOW, is_cap=CAP)
    res, thetas = {}, {}
    for lname, sched, chunk in [("sync", dict(schedule="sync", shared_prefix=False), 1),
                                # one source per pass: mini-batches 2..m alone too
                                ("ts", dict(schedule="thundersync", k_open=1,
                                            max_tokens_per_pass=0), 1),
                                ("ts_packed", dict(schedule="thundersync", k_open=2), 4)]:
        ln = make_learner(parallel1, tiny_qwen2, **kw, **sched)
        res[lname] = run_update(ln, as_sources(rows), chunk)
        # θ before steps 2..m (the update reports them when asked for its gradients), and after
        thetas[lname] = [{k: v.double() for k, v in p.items()}
                         for p in [*res[lname].minibatch_params, ln.policy.export_params()]]
    s = res["ts"].summary
    assert s.minibatch_steps == m and len(res["ts"].minibatch_grads) == m and s.ok
    # registration order: plan groups in first-arrival order, m contiguous parts
    from tsync_mcore.channel.sources import BatchPlan
    from tsync_mcore.learner.minibatch import split
    parts = split(BatchPlan.from_sources(as_sources(rows)), m)
    ref_model = _hf(ref_dir) if ref_dir else None
    for j, part in enumerate(parts):
        sub = [r for r in rows if r["group_id"] in part]
        err_ref = 0.0
        for lname, r in res.items():  # each learner at the θ its own previous step left
            at = _hf(tiny_qwen2)
            if j:
                at.load_state_dict(thetas[lname][j - 1], strict=False)
            ref = ppo_objective(at, model0, ref_model, sub, clip=clip, kl=beta, ent=eta,
                             guard=(LOW, CAP) if mis else None)
            err_ref = max(err_ref, rel_l2(r.minibatch_grads[j], ref))
        err = max(rel_l2(r.minibatch_grads[j], res["sync"].minibatch_grads[j])
                  for k, r in res.items() if k != "sync")
        print(f"{name} mini-batch {j + 1}: thundersync vs sync {err:.2e}, "
              f"vs FP64 at its θ {err_ref:.2e}")
        assert err_ref <= 1e-5, (j, err_ref)
        # step 1 is the streamed one; each later step starts from a θ that carries step 1's
        # FP32 rounding (streamed or not) through Adam, so its gradient differs by a little
        # more than the rounding itself
        assert err <= (1e-6 if j == 0 else 1e-5), (j, err)
    # the update sequence: θ after all m steps, thundersync's as sync's
    theta0 = {k: v.double() for k, v in model0.state_dict().items()}
    moved = sum(float(((thetas["sync"][-1][k] - theta0[k]) ** 2).sum())
                for k in thetas["sync"][-1]) ** 0.5
    for lname in ("ts", "ts_packed"):
        gap = sum(float(((thetas[lname][-1][k] - thetas["sync"][-1][k]) ** 2).sum())
                  for k in thetas["sync"][-1]) ** 0.5
        print(f"{name}: θ after {m} steps, {lname} vs sync: gap / moved = {gap / moved:.2e}")
        assert gap / moved <= 1e-6
    print(f"{name}: clipfrac {s.pg_clipfrac:.3f}, lower {s.pg_clipfrac_lower:.3f}, "
          f"ppo_kl {s.ppo_kl:.2e}")
    assert s.pg_clipfrac > 0 and s.ppo_kl != 0
    if clip[2] < 2:
        assert s.pg_clipfrac_lower > 0
    # mini-batch 1 at θ_k: every ratio 1, the clip never binds, the streamed gradient
    assert Clip(*clip).token_losses(torch.zeros(3), torch.zeros(3), -1.0)[1].sum() == 0


def test_minibatch_refusals():
    from tsync_mcore.config import ConfigError, load_config
    for overrides, match in [
        ({"learner.minibatches": 0}, "learner.minibatches"),
        ({"learner.minibatches": 2, "learner.objective": "opd"}, "OPD's turns"),
        ({"learner.minibatches": 2, "learner.schedule": "one_step_off"}, "synchronous"),
        ({"learner.clip_dual": 0.5}, "must be > 1"),
        ({"learner.clip_low": 1.5}, "must be in"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
