"""How each source kind is served: what a source is, when its group is complete, what an
open group holds, and the work of one release unit. The learner's lifecycle is the same
for every kind (tsync_mcore.learner.update)."""

from tsync_mcore.learner.serving.trajectory import TrajectoryKind
from tsync_mcore.learner.serving.turn import TurnKind

SOURCE_KINDS = {"trajectory": TrajectoryKind, "turn": TurnKind}

__all__ = ["SOURCE_KINDS", "TrajectoryKind", "TurnKind"]
