"""What a serving kind sees of the learner: the update in progress, narrowed to the names in
`SEEN` (a read of any other name raises AttributeError naming it).

A kind reads its view and returns what its service did (the spans it ran); it writes
nothing into the update. Its gradient reaches the batch through the accumulators and the
fold callbacks below, which are also where the update learns which groups are in the batch
(`GradAccumulators.committed`)."""

from __future__ import annotations

SEEN = frozenset({
    # the learner's parts, fixed for its life
    "cfg", "policy", "acc", "routes", "off_policy", "reg", "objective", "norm", "adv_ddof",
    "max_tokens", "kv_per_token", "version",
    # what a kind calls back: folds into the batch, deferred trace records, K/V sizes, clock
    "fold_direct", "fold_later", "flush_grads", "defer", "saw_kv", "now",
    # a source's KL/entropy term with its reference log-probs (objectives/regularizers.py)
    "regularizer",
})
# the batch being served (learner/batch.py), read from the learner's open BatchState
BATCH_SEEN = frozenset({"plan", "queue", "member_of", "arrived"})


class UpdateView:
    """A read-only window on a `Learner` that shows only `SEEN` and `BATCH_SEEN`."""

    __slots__ = ("_learner",)

    def __init__(self, learner) -> None:
        object.__setattr__(self, "_learner", learner)

    def __getattr__(self, name: str):
        if name in BATCH_SEEN:
            return getattr(self._learner.batch, name)
        if name not in SEEN:
            raise AttributeError(f"a serving kind sees only "
                                 f"{', '.join(sorted(SEEN | BATCH_SEEN))} of the learner, "
                                 f"not {name!r} (learner/serving/view.py)")
        return getattr(self._learner, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a serving kind cannot set the learner's {name!r}")
