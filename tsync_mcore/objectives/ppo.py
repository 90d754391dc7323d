"""PPO's clipped surrogate for mini-batch steps (`learner.minibatches` m > 1;
docs/design/objectives.md#ppo-mini-batches).

The batch's groups split into m mini-batches in registration order; each takes one
optimizer step. With r_t = π_θ(a_t)/π_θk(a_t) against the policy θ_k that sampled the batch
(its log-probs from the learner's own forward when the source arrived) and ε_l, ε_h =
`clip_low`, `clip_high` (clip-higher: ε_h > ε_l), c = `clip_dual`:

    ℓ_t = max(−A·r_t, −A·clip(r_t, 1 − ε_l, 1 + ε_h))         (A ≥ 0, or c = 0)
    ℓ_t = min(max(−A·r_t, −A·clip(r_t, 1 − ε_l, 1 + ε_h)), −A·c)   (A < 0: dual clip)

and a source's loss is w·Σ_t ρ_t·ℓ_t, w its token weight (objectives/token_norm.py) and ρ_t
the mismatch guard's weight fixed at arrival from log π_θk (objectives/off_policy.py), as
verl's `compute_policy_loss_vanilla` (clip_ratio_low/high, clip_ratio_c) with
rollout_is_weights. Mini-batch 1 runs at θ_k itself: r = 1, inside every clip range, and
ℓ's gradient is −A·∇log π — the streamed policy gradient, so it streams as m = 1 does.
Mini-batch j ≥ 2 runs once step j − 1 is applied; ℓ is not affine in the rewards (the clip
depends on A's sign), so its sources fold directly, with their group's rewards known.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Clip:
    low: float = 0.2  # ε_l (verl clip_ratio_low)
    high: float = 0.2  # ε_h (verl clip_ratio_high; > ε_l: DAPO's clip-higher)
    dual: float = 3.0  # c (verl clip_ratio_c); 0: no dual clip

    def token_losses(self, logp: torch.Tensor, old_logp: torch.Tensor, adv: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ℓ_t with the graph, clipped by the ratio range, clipped by the dual bound) for
        one source's scored tokens; `old_logp` detached."""
        log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # as verl, for exp
        ratio = torch.exp(log_ratio)
        plain = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - self.low, 1.0 + self.high)
        loss = torch.maximum(plain, clipped)
        cut = clipped > plain
        lower = torch.zeros_like(cut)
        if self.dual and adv < 0:
            bound = torch.full_like(loss, -adv * self.dual)
            lower = loss > bound
            loss = torch.minimum(loss, bound)
        return loss, cut.detach(), lower.detach()


@dataclass
class ClipStats:
    """One update's PPO figures over the scored tokens of mini-batches 2..m."""

    tokens: int = 0
    clipped: int = 0  # the ratio range was binding (verl actor/pg_clipfrac)
    clipped_lower: int = 0  # the dual bound was binding (actor/pg_clipfrac_lower)
    kl_sum: float = 0.0  # Σ (log π_θk − log π_θ) (actor/ppo_kl)

    def means(self) -> dict:
        n = self.tokens
        return dict(pg_clipfrac=self.clipped / n if n else None,
                    pg_clipfrac_lower=self.clipped_lower / n if n else None,
                    ppo_kl=self.kl_sum / n if n else None)
