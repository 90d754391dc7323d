"""What a serving kind sees of the learner: the update in progress, narrowed to the names in
`SEEN` (a read of any other name raises AttributeError naming it; nothing is written back
except through the callbacks)."""

from __future__ import annotations

SEEN = frozenset({
    # the learner's parts, fixed for its life
    "cfg", "policy", "acc", "routes", "off_policy", "reg", "objective", "norm", "adv_ddof",
    "max_tokens", "kv_per_token",
    # the batch being served (set when it begins)
    "version", "plan", "queue", "member_of", "arrived", "committed",
    # what a kind calls back: folds into the batch, deferred trace records, K/V sizes, clock
    "fold_direct", "fold_later", "flush_grads", "defer", "saw_kv", "now",
    # a source's KL/entropy term with its reference log-probs (objectives/regularizers.py)
    "regularizer",
})


class UpdateView:
    """A read-only window on a `Learner` that shows only `SEEN`."""

    __slots__ = ("_learner",)

    def __init__(self, learner) -> None:
        object.__setattr__(self, "_learner", learner)

    def __getattr__(self, name: str):
        if name not in SEEN:
            raise AttributeError(f"a serving kind sees only {', '.join(sorted(SEEN))} of the "
                                 f"learner, not {name!r} (learner/serving/view.py)")
        return getattr(self._learner, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a serving kind cannot set the learner's {name!r}")
