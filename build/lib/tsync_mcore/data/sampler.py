"""Which row training visits at data position p.

Position p (the count of prompts handed out so far; checkpointed as `data_pos` and carried
by Hello/RegisterBatch) maps to row `perm(seed, epoch)[p % N]` with epoch = p // N: a new
permutation every epoch, a pure function of (seed, p). A run resumed at data_pos therefore
sees exactly the prompts an uninterrupted run would have seen, mid-epoch included.
"""

from __future__ import annotations

import numpy as np


class EpochSampler:
    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n < 1:
            raise ValueError(f"EpochSampler: need at least one row, got {n}")
        self.n, self.seed, self.shuffle = n, int(seed), shuffle
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> np.ndarray:
        """The row order of `epoch` (PCG64 seeded with (seed, epoch): stable across numpy)."""
        if not self.shuffle:
            return np.arange(self.n)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed & (2**63 - 1),
                                                                          epoch])))
        return rng.permutation(self.n)

    def index(self, pos: int) -> int:
        if pos < 0:
            raise ValueError(f"EpochSampler: negative data position {pos}")
        epoch = pos // self.n
        if epoch != self._epoch:  # one permutation held: positions advance monotonically
            self._epoch, self._perm = epoch, self.permutation(epoch)
        return int(self._perm[pos % self.n])

    def epoch(self, pos: int) -> int:
        return pos // self.n
