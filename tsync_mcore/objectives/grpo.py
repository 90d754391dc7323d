"""GRPO and its affine-advantage relatives, as scalars on two running sums (docs/design.md).

Every estimator here has advantages A_i = α_G · (r_i − μ_G) with α_G fixed by group
statistics (GRPO: 1/(σ_G+ε); Dr.GRPO: 1; RLOO: m/(m−1)). The group direction is

    g_G = (1/m) Σ_i A_i H_i = (α_G/m) · (G1' − (μ_G − c)·G2),
    G1' = Σ_i (r_i − c) H_i,   G2 = Σ_i H_i,

where c is the group's first arrived reward. Accumulating around c instead of 0 is exact
algebra and avoids the catastrophic cancellation of Σ r_i H_i − μ Σ H_i when rewards are
large relative to their spread; a uniform-reward group gives exact zeros. μ, σ and c are
float64, and μ − c is computed as mean(r_i − c) so it is exactly 0 for a uniform group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class GroupStats:
    m: int
    mean: float  # μ_G
    std: float  # population std (unbiased=False)
    mean_minus_shift: float  # μ_G − c, computed from the shifted rewards


def group_stats(rewards: list[float], shift: float) -> GroupStats:
    m = len(rewards)
    dev = [float(r) - shift for r in rewards]  # float64 in Python
    mean_dev = math.fsum(dev) / m
    var = math.fsum((d - mean_dev) ** 2 for d in dev) / m
    return GroupStats(m=m, mean=shift + mean_dev, std=math.sqrt(var), mean_minus_shift=mean_dev)


@dataclass(frozen=True)
class AffineAdvantage:
    """A_i = alpha(stats) · (r_i − μ_G)."""

    name: str
    alpha: Callable[[GroupStats, float], float]  # (stats, eps) -> α_G
    source = "trajectory"  # its sources: whole trajectories (tsync_mcore.serving)
    group_vectors = 2  # an open group holds G1' and G2
    routings = ("static", "balanced")  # members may be served on several ranks

    def advantages(self, rewards: list[float], eps: float) -> list[float]:
        st = group_stats(rewards, rewards[0])
        a = self.alpha(st, eps)
        return [a * ((float(r) - rewards[0]) - st.mean_minus_shift) for r in rewards]

    def source_coef(self, rewards: list[float], i: int, eps: float) -> float:
        """Coefficient of H_i in g_G when all rewards are known: A_i / m."""
        return self.advantages(rewards, eps)[i] / len(rewards)

    def closure(self, rewards: list[float], shift: float, eps: float) -> tuple[float, float]:
        """(scale, mu) such that g_G = scale · (G1' − mu · G2), G1' accumulated around shift."""
        st = group_stats(rewards, shift)
        return self.alpha(st, eps) / st.m, st.mean_minus_shift


def _rloo_alpha(st: GroupStats, eps: float) -> float:
    # A_i = r_i − mean_{j≠i} r_j = m/(m−1) · (r_i − μ); a lone trajectory has no baseline.
    return 0.0 if st.m < 2 else st.m / (st.m - 1)


ADVANTAGES: dict[str, AffineAdvantage] = {
    "grpo": AffineAdvantage("grpo", lambda st, eps: 1.0 / (st.std + eps)),
    "dr_grpo": AffineAdvantage("dr_grpo", lambda st, eps: 1.0),
    "rloo": AffineAdvantage("rloo", _rloo_alpha),
}
