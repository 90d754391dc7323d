"""FP64 references of the regularized objectives, written per sequence on the Hugging Face
model (autograd, no Megatron): KL to a reference policy from Schulman's estimators, the
entropy bonus, masked IS and PPO's clipped objective (test_regularizers,
test_ppo_minibatches, test_dynamic_sampling)."""

from __future__ import annotations

import torch

from tests.helpers.reference import grpo_members

VOCAB = 256
LOW, CAP = 0.6, 2.0  # masked IS bounds (the guard drops some tokens, not all)


def kl_estimate(x: torch.Tensor, est: str) -> torch.Tensor:
    """The estimators written out from Schulman's note (x = log π − log π_ref)."""
    if est == "k1":
        return x
    if est == "k2":
        return x * x / 2
    d = (-x).clamp(-20, 20)
    return (d.exp() - d - 1).clamp(-10, 10)


def objective(model, ref_model, rows, *, kl_coef=0.0, est="k3", ent_coef=0.0,
              guard=None) -> torch.Tensor:
    """J = (1/n_groups) Σ_G (1/m) Σ_i (1/L_i) Σ_t [A_i ρ_t lp_t − β k_t + η H_t] in FP64
    (token_norm trajectory, GRPO advantages; ρ_t masked IS when `guard`), with the graph."""
    J = torch.zeros((), dtype=torch.float64)
    for a, r, wg in grpo_members(rows):
        at = [t for t in range(1, len(r["tokens"])) if r["scored_mask"][t]]
        if not at:
            continue
        ids = torch.tensor(r["tokens"])
        logsm = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], dim=-1)
        idx = torch.tensor(at) - 1
        lp = logsm[idx, ids[at]]
        rho = torch.ones_like(lp)
        if guard is not None:
            b = torch.tensor([r["behaviour_logprobs"][t] for t in at], dtype=torch.float64)
            ratio = (lp.detach() - b).exp()
            rho = torch.where((ratio >= guard[0]) & (ratio <= guard[1]), ratio, 0.0)
        term = a * rho * lp
        if kl_coef:
            with torch.no_grad():
                ref_lp = torch.log_softmax(ref_model(ids[None]).logits[0, :-1],
                                           dim=-1)[idx, ids[at]]
            term = term - kl_coef * kl_estimate(lp - ref_lp, est)
        if ent_coef:
            p = logsm[idx].exp()
            term = term + ent_coef * -(p * logsm[idx]).sum(-1)
        J = J + wg * term.sum() / len(at)
    return J


def reference_objective(model, ref_model, rows, **terms) -> dict:
    """∇ of `objective` with respect to every parameter of `model`."""
    J = objective(model, ref_model, rows, **terms)
    params = list(model.named_parameters())
    grads = torch.autograd.grad(J, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}


def ppo_objective(model, old_model, ref_model, rows, *, clip, kl=0.0, ent=0.0, guard=None):
    """J = (1/n_groups) Σ_G (1/m) Σ_i (1/L_i) Σ_t [ρ_t·obj_t − β k_t + η H_t] with PPO's
    clipped objective obj_t = min(r·A, clip(r)·A), for A < 0 floored at c·A (dual)."""
    low, high, dual = clip
    J = torch.zeros((), dtype=torch.float64)
    for a, r, wg in grpo_members(rows):
        at = [t for t in range(1, len(r["tokens"])) if r["scored_mask"][t]]
        if not at:
            continue
        ids, idx = torch.tensor(r["tokens"]), torch.tensor(at) - 1
        logsm = torch.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
        lp = logsm[idx, ids[at]]
        with torch.no_grad():
            old = torch.log_softmax(old_model(ids[None]).logits[0, :-1], -1)[idx, ids[at]]
        ratio = torch.exp(lp - old)
        obj = torch.minimum(ratio * a, ratio.clamp(1 - low, 1 + high) * a)
        if a < 0 and dual:
            obj = torch.maximum(obj, torch.full_like(obj, dual * a))
        if guard is not None:
            b = torch.tensor([r["behaviour_logprobs"][t] for t in at], dtype=torch.float64)
            w = (old - b).exp()
            obj = obj * torch.where((w >= guard[0]) & (w <= guard[1]), w, 0.0)
        term = obj
        if kl:
            with torch.no_grad():
                ref = torch.log_softmax(ref_model(ids[None]).logits[0, :-1], -1)[idx, ids[at]]
            term = term - kl * kl_estimate(lp - ref, "k3")
        if ent:
            term = term + ent * -(logsm[idx].exp() * logsm[idx]).sum(-1)
        J = J + wg * term.sum() / len(at)
    params = list(model.named_parameters())
    grads = torch.autograd.grad(J, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}
