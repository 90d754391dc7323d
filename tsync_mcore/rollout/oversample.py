"""DAPO's dynamic sampling on the rollout side (`learner.filter_groups: zero_std` with
`rollout.max_oversample` reserve groups; docs/design/objectives.md#dynamic-sampling).

A batch registers its `groups_per_batch` groups and up to `max_oversample` reserves. The
first `groups_per_batch` start at once; a reserve starts only when a started group finishes
with every reward equal (the learner drops such a group itself at its close: its advantage
is zero, so it would only dilute the token norms), so the batch keeps sampling until it has
its `groups_per_batch` informative groups or runs out of reserves. Reserves never started
are dropped before the batch closes (DropGroup): nothing of them was sent.

As verl's DAPO trainer (`algorithm.filter_groups`, `max_num_gen_batches`), but one group at
a time instead of a whole generation batch, so the learner streams the groups that train
while the replacements are sampled.
"""

from __future__ import annotations

import asyncio


def uniform(rewards: list[float]) -> bool:
    """Every reward equal: zero standard deviation, zero advantage (and a group of one)."""
    return all(r == rewards[0] for r in rewards)


class Oversampling:
    def __init__(self, groups: dict[str, list[str]], needed: int):
        order = list(groups)
        self.size = {g: len(ts) for g, ts in groups.items()}
        self.started = set(order[:needed])
        self.reserves = order[needed:]
        self._go = {g: asyncio.Event() for g in self.reserves}
        self._run: dict[str, bool] = {}
        self._rewards: dict[str, list[float]] = {g: [] for g in order}
        self.finished: set[str] = set()  # started groups whose members all ended
        self.filtered = 0  # groups that ended with uniform rewards
        self.failed = 0  # groups with a member that ended without a reward (dropped)
        self.oversampled = 0  # reserves started

    async def gate(self, g: str) -> bool:
        """Wait until group `g` may be sampled; False: it never will (skip its members)."""
        if g in self.started:
            return True
        await self._go[g].wait()
        return self._run[g]

    def member_done(self, g: str, reward: float | None) -> None:
        """A member of started group `g` ended (None: without a usable reward, e.g. its
        group was dropped): at the last one the group is judged."""
        self._rewards[g].append(reward)
        if len(self._rewards[g]) < self.size[g]:
            return
        self.finished.add(g)
        rs = self._rewards[g]
        if None in rs:
            self.failed += 1
        elif uniform(rs):
            self.filtered += 1
            self._start_reserve()
        self._maybe_end()

    def _start_reserve(self) -> None:
        if self.reserves:
            g = self.reserves.pop(0)
            self.started.add(g)
            self.oversampled += 1
            self._run[g] = True
            self._go[g].set()

    def _maybe_end(self) -> None:
        """Once every started group has ended, no reserve can start any more."""
        if self.finished >= self.started:
            for g in self.reserves:
                self._run[g] = False
                self._go[g].set()

    def unused(self) -> list[str]:
        """Reserves that were never started (to drop before the batch closes)."""
        return [g for g in self._go if not self._run.get(g, False)]

    def metrics(self) -> dict[str, float]:
        return {"rollout/oversampled_groups": float(self.oversampled),
                "rollout/informative_groups": float(len(self.finished) - self.filtered
                                                    - self.failed)}
