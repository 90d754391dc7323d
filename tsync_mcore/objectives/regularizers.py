"""KL to a reference policy and the entropy bonus: per-token terms beside the policy gradient
(docs/design/objectives.md#kl-and-entropy).

A source's scored tokens t carry, next to its policy-gradient term, the regulariser

    R_i = Σ_t [ β · k(log π_θ(a_t), log π_ref(a_t)) − η · H_t(π_θ) ]

with β = `learner.kl_coef`, η = `learner.entropy_coef`, H_t the entropy of π_θ(· | h_t) over
the whole vocabulary and k the estimator (`learner.kl_estimator`; x = log π_θ − log π_ref):

    k1   x                                      verl `kl` / `k1`
    abs  |x|                                    verl `abs`
    k2   x² / 2                                 verl `mse` / `k2`
    k3   e^(−x) + x − 1, x ∈ [−20, 20], ≤ 10     verl `low_var_kl` / `k3` (the same clamps)
    k1+, k3+  the value of k1/k3 with k2's gradient (verl's straight-through `k1+`, `k3+`)

R_i is minimised with the same token weights as the policy term, as verl's `agg_loss` does
with one `loss_agg_mode` for all three: its coefficient is c = w(L_i) · (1/m_G) · 1/D of
objectives/token_norm.py, without the advantage. Every part of c but 1/D is known when the
source arrives, and 1/D is the deferred scalar at close, so R_i's gradient is fixed at
arrival: no group statistics, no reward. Under streaming it still cannot ride in a pair
fold's backward (G1' and G2 take the policy term with reward-dependent coefficients), so a
pair fold backpropagates R_i on its own and the group holds it in a third sum until it is
known to train (learner/accumulators.py); a direct fold puts both in one loss.

log π_ref comes from the reference model's forward of the source (learner/reference.py), at
the same time as the policy's: detached, so the estimator's gradient is k'(x) ∇ log π_θ.
The importance weights of objectives/off_policy.py do not touch R_i (as verl's
rollout_is_weights multiply only the policy loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch in the functions: config validation reads the names without it
    import torch

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "k3+")
# verl's kl_loss_type names → ours (slime's --kl-loss-type uses k1/k2/k3/low_var_kl too)
VERL_KL = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3",
           "k3": "k3", "k1+": "k1+", "k3+": "k3+", "low_var_kl+": "k3+"}


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """k(log π_θ, log π_ref) per token, differentiable in `logp` (`ref` detached)."""
    base = estimator.rstrip("+")
    x = logp - ref
    if base == "k1":
        value = x
    elif base == "abs":
        value = x.abs()
    elif base == "k2":
        value = 0.5 * x.square()
    elif base == "k3":
        import torch
        d = torch.clamp(-x, min=-20.0, max=20.0)  # log π_ref − log π_θ, clamped as verl
        value = torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    else:
        raise ValueError(f"unknown kl_estimator {estimator!r} (have {KL_ESTIMATORS})")
    if not estimator.endswith("+") or base == "k2":
        return value
    grad_of = 0.5 * x.square()  # straight through: k2's gradient, the estimator's value
    return grad_of - grad_of.detach() + value.detach()


@dataclass(frozen=True)
class Regularizer:
    """`learner.kl_coef`, `kl_estimator` and `entropy_coef` (β, k, η)."""

    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.kl_coef or self.entropy_coef)

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef != 0.0

    def loss(self, logp: torch.Tensor, entropy: torch.Tensor,
             ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(R = Σ_t β·k_t − η·H_t with the graph, Σ_t k_t detached) over one source's scored
        tokens (R in the log-probs' dtype; the KL sum in float64, for the metric)."""
        import torch
        r = logp.new_zeros(())
        kl_sum = torch.zeros((), dtype=torch.float64, device=logp.device)
        if self.kl_coef:
            k = kl_estimate(logp, ref.to(logp.dtype), self.kl_estimator)
            r = r + self.kl_coef * k.sum()
            kl_sum = k.detach().sum(dtype=torch.float64)
        if self.entropy_coef:
            r = r - self.entropy_coef * entropy.sum()
        return r, kl_sum
