"""The math: objectives turn rewards (or teacher scores) into the scalars that combine
per-source gradients. One file per objective; each names the source kind it trains on."""

from tsync_mcore.objectives.grpo import ADVANTAGES, AffineAdvantage, GroupStats, group_stats
from tsync_mcore.objectives.opd import Distillation

OBJECTIVES = {**ADVANTAGES, "opd": Distillation()}

__all__ = ["ADVANTAGES", "OBJECTIVES", "AffineAdvantage", "Distillation", "GroupStats",
           "group_stats"]
