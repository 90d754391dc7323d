"""The math: objectives turn rewards into the scalars that combine per-source gradients."""

from tsync_mcore.objectives.grpo import ADVANTAGES, AffineAdvantage, GroupStats, group_stats

__all__ = ["ADVANTAGES", "AffineAdvantage", "GroupStats", "group_stats"]
