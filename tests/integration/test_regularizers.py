"""KL to a reference policy and the entropy bonus (objectives/regularizers.py), streamed.

Each term's gradient is fixed when its source arrives: thundersync (pair folds, shared
prompts, packed pair passes) equals sync, and both equal an independent FP64 reference
written per sequence on the Hugging Face model — the KL estimators from their formulas,
the entropy from the full softmax — alone and combined with masked IS; at TP = 1 in
process and TP = 2 through the replay command; the LoRA reference is the base with the
adapters off; OPD's entropy bonus; the figures (actor/kl, reference bytes and tokens, the
ledger's reference FLOPs) and the refusals.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import make_batch
from tests.helpers.off_policy import _hf, _with_behaviour
from tests.helpers.reference import advantages, rel_l2

VOCAB = 256
LOW, CAP = 0.6, 2.0  # masked IS bounds (the guard drops some tokens, not all)


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    """A reference checkpoint of the same vocabulary that is not θ_0 (another seed), so
    every estimator's gradient is far from zero."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    out = str(tmp_path_factory.mktemp("reference") / "ref")
    make_tiny_checkpoint(out, arch="qwen2", seed=7)
    return out


def _k(x: torch.Tensor, est: str) -> torch.Tensor:
    """The estimators written out from Schulman's note (x = log π − log π_ref)."""
    if est == "k1":
        return x
    if est == "k2":
        return x * x / 2
    d = (-x).clamp(-20, 20)
    return (d.exp() - d - 1).clamp(-10, 10)


def reference_objective(model, ref_model, rows, *, kl_coef=0.0, est="k3", ent_coef=0.0,
                        guard=None) -> dict:
    """∇ of J = (1/n_groups) Σ_G (1/m) Σ_i (1/L_i) Σ_t [A_i ρ_t lp_t − β k_t + η H_t]
    in FP64 (token_norm trajectory, GRPO advantages; ρ_t masked IS when `guard`)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    J = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        adv = advantages(torch.tensor([r["reward"] for r in members], dtype=torch.float64),
                         "grpo")
        for a, r in zip(adv, members):
            at = [t for t in range(1, len(r["tokens"])) if r["scored_mask"][t]]
            if not at:
                continue
            ids = torch.tensor(r["tokens"])
            logsm = torch.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
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
                term = term - kl_coef * _k(lp - ref_lp, est)
            if ent_coef:
                p = logsm[idx].exp()
                term = term + ent_coef * -(p * logsm[idx]).sum(-1)
            J = J + term.sum() / (len(groups) * len(members) * len(at))
    params = list(model.named_parameters())
    grads = torch.autograd.grad(J, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}
