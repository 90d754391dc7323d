"""GRPO and its affine-advantage relatives, as scalars on two running sums (docs/design/README.md).

Every estimator here has advantages A_i = α_G · (r_i − μ_G) with α_G fixed by group
statistics (GRPO: 1/(σ_G+ε); Dr.GRPO: 1; RLOO: m/(m−1)). The group direction is

    g_G = (1/m) Σ_i A_i H_i = (α_G/m) · (G1' − (μ_G − c)·G2),
    G1' = Σ_i (r_i − c) H_i,   G2 = Σ_i H_i,

where c is the group's first arrived reward. Accumulating around c instead of 0 is exact
algebra and avoids the catastrophic cancellation of Σ r_i H_i − μ Σ H_i when rewards are
large relative to their spread; a uniform-reward group gives exact zeros. μ, σ and c are
float64, and μ − c is computed as mean(r_i − c) so it is exactly 0 for a uniform group.

`group_mean=False` drops the 1/m (g_G = Σ_i A_i H_i): the token normalisations that weight
sequences or tokens of the whole batch equally apply their own batch-level divisor
(objectives/token_norm.py). `ddof` picks σ's divisor: m − 0 (population, the default) or
m − 1 (Bessel-corrected, as verl and TRL); a lone trajectory has σ = 0 either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class GroupStats:
    m: int
    mean: float  # μ_G
    std: float  # sqrt(Σ (r_i − μ)² / (m − ddof)); 0 for a lone trajectory
    mean_minus_shift: float  # μ_G − c, computed from the shifted rewards


# learner.adv_std → the divisor's offset: population std divides by m, unbiased by m − 1
STD_DDOF = {"population": 0, "unbiased": 1}


def group_stats(rewards: list[float], shift: float, ddof: int = 0) -> GroupStats:
    m = len(rewards)
    dev = [float(r) - shift for r in rewards]  # float64 in Python
    mean_dev = math.fsum(dev) / m
    # A lone trajectory under ddof=1 would be 0/0 (torch: NaN; verl sets σ = 1 and μ = 0,
    # so A = r/(1+ε); TRL's advantage becomes 0). Here σ = 0: its r − μ is exactly 0, so
    # A = 0 exactly under every estimator.
    var = math.fsum((d - mean_dev) ** 2 for d in dev) / (m - ddof) if m > ddof else 0.0
    return GroupStats(m=m, mean=shift + mean_dev, std=math.sqrt(var), mean_minus_shift=mean_dev)


@dataclass(frozen=True)
class AffineAdvantage:
    """A_i = alpha(stats) · (r_i − μ_G)."""

    name: str
    alpha: Callable[[GroupStats, float], float]  # (stats, eps) -> α_G
    uses_std: bool = False  # α_G depends on σ_G (learner.adv_std matters)
    source = "trajectory"  # its sources: whole trajectories (tsync_mcore.learner.serving)
    group_vectors = 2  # an open group holds G1' and G2
    routings = ("static", "balanced")  # members may be served on several ranks

    def advantages(self, rewards: list[float], eps: float, ddof: int = 0) -> list[float]:
        st = group_stats(rewards, rewards[0], ddof)
        a = self.alpha(st, eps)
        return [a * ((float(r) - rewards[0]) - st.mean_minus_shift) for r in rewards]

    def source_coef(self, rewards: list[float], i: int, eps: float, ddof: int = 0,
                    group_mean: bool = True) -> float:
        """Coefficient of H_i in g_G when all rewards are known: A_i / m (or A_i)."""
        a = self.advantages(rewards, eps, ddof)[i]
        return a / len(rewards) if group_mean else a

    def closure(self, rewards: list[float], shift: float, eps: float, ddof: int = 0,
                group_mean: bool = True) -> tuple[float, float]:
        """(scale, mu) such that g_G = scale · (G1' − mu · G2), G1' accumulated around shift."""
        st = group_stats(rewards, shift, ddof)
        a = self.alpha(st, eps)
        return (a / st.m if group_mean else a), st.mean_minus_shift


def _rloo_alpha(st: GroupStats, eps: float) -> float:
    # A_i = r_i − mean_{j≠i} r_j = m/(m−1) · (r_i − μ); a lone trajectory has no baseline.
    return 0.0 if st.m < 2 else st.m / (st.m - 1)


ADVANTAGES: dict[str, AffineAdvantage] = {
    "grpo": AffineAdvantage("grpo", lambda st, eps: 1.0 / (st.std + eps), uses_std=True),
    "dr_grpo": AffineAdvantage("dr_grpo", lambda st, eps: 1.0),
    "rloo": AffineAdvantage("rloo", _rloo_alpha),
}
