"""On-policy distillation (docs/design/opd.md; the paper's Eq. 8–9).

A_{j,t} = sg[log π_T(a_t|h_t) − log π_θk(a_t|h_t)]; a turn contributes
g_j = Σ_t A_{j,t} ∇ log π_θ(a_t|h_t), and g_k = (1/N_k) Σ_j g_j with N_k the global scored-
token count, known only at batch close (a deferred scalar, all-reduced across ranks).
The student log-prob comes from the learner's own forward of the turn, so ratio = 1 and
its derivative is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: config validation imports OBJECTIVES without torch
    import torch


class Distillation:
    """Per-token advantages against a frozen teacher, on turn sources."""

    name = "opd"
    source = "turn"  # its sources: scored turns (tsync_mcore.learner.serving)
    group_vectors = 1  # an open group holds only its plain gradient sum
    routings = ("static",)  # a trajectory's turns and its group's prompt stay on one rank

    @staticmethod
    def turn_loss(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                  rho: torch.Tensor | None = None) -> torch.Tensor:
        return turn_loss(student_logp, teacher_logp, rho)


def turn_loss(student_logp: torch.Tensor, teacher_logp: torch.Tensor,
              rho: torch.Tensor | None = None) -> torch.Tensor:
    """−Σ_t ρ_t·A_t · log π_θ(a_t): its gradient is −g_j (descent on the turn's objective).
    ρ_t: the truncated IS weight (objectives/off_policy.py); None is 1."""
    advantage = (teacher_logp.to(student_logp.dtype) - student_logp).detach()
    if rho is not None:
        advantage = advantage * rho
    return -(advantage * student_logp).sum()
