"""Off-policy correction and the rollout/learner mismatch (docs/design/async.md#off-policy-correction-and-the-lag-and-mismatch-figures).

A scored token a_t sampled by the rollout with log-prob log π_b(a_t) (its *behaviour*
log-prob) trains under truncated importance sampling (TIS, `learner.is_correction: tis`):

    ρ_t = min(exp(log π_θ(a_t) − log π_b(a_t)), C)          C = learner.is_cap

detached, a constant per-token weight: the source's loss −w·Σ_t log π_θ(a_t) becomes
−w·Σ_t ρ_t·log π_θ(a_t) (GRPO), and an OPD turn's −Σ_t A_t·log π_θ(a_t) becomes
−Σ_t ρ_t·A_t·log π_θ(a_t). log π_θ is the learner's own forward (the one the backward runs
through), so ρ_t needs nothing extra. The weight is per token and fixed before the
backward, so every streaming identity (G1'/G2 running sums, group closure, the shared
prompt's adjoints, OPD's context replay) stays linear in it and exact. As verl's
token-level rollout importance sampling in truncate mode (`rollout_is_threshold`) and
slime's TIS (`--tis-clip`): the cap bounds the variance a stale or mismatched token adds.

Whenever a source carries behaviour log-probs — correction on or off, any schedule — the
same pass adds to the mismatch statistics, kept on the device and read once per update
(`take`): Σ |log π_θ − log π_b|, and the raw ratio's sum, max and min and how many tokens
the cap would truncate. Off, they say what TIS would do; on a synchronous schedule they
measure the rollout/learner numerical difference alone (the ratio is 1 in exact math).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsync_mcore.platform import upload

CORRECTIONS = ("none", "tis")


def behaviour_at(behaviour, mask, offset: int = 0) -> list[float]:
    """The behaviour log-probs of the scored tokens of `mask` (mask[i] belongs to token
    offset + i of the source's `behaviour`); [] when the source sent none."""
    if not behaviour:
        return []
    return [float(behaviour[offset + i]) for i, m in enumerate(mask) if m]


def scored_positions(mask, offset: int = 0) -> list[int]:
    """Indices i of the scored tokens of `mask[offset:]` (built on the host: `nonzero` of a
    device mask would make the host wait for the device)."""
    return [i for i, m in enumerate(mask[offset:]) if m]


def truncated_ratio(logp: torch.Tensor, behaviour: torch.Tensor,
                    cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ = min(π_θ/π_b, cap), the raw ratio π_θ/π_b), both detached, in float64."""
    ratio = torch.exp(logp.detach().to(torch.float64) - behaviour)
    return ratio.clamp(max=cap), ratio


@dataclass
class MismatchStats:
    """One update's figures over the scored tokens that carried behaviour log-probs."""

    mismatch_tokens: int = 0  # scored tokens with a behaviour log-prob
    logprob_diff_sum: float = 0.0  # Σ |log π_θ − log π_b|
    is_weight_sum: float = 0.0  # Σ π_θ/π_b (untruncated)
    is_weight_max: float | None = None
    is_weight_min: float | None = None
    truncated: int = 0  # tokens with π_θ/π_b > cap

    def means(self) -> dict:
        """The UpdateRecord / metrics names (None where no token carried a log-prob)."""
        n = self.mismatch_tokens
        return dict(mismatch_tokens=n,
                    logprob_diff_mean=self.logprob_diff_sum / n if n else None,
                    is_weight_mean=self.is_weight_sum / n if n else None,
                    is_weight_max=self.is_weight_max if n else None,
                    is_weight_min=self.is_weight_min if n else None,
                    is_truncated_share=self.truncated / n if n else None)


class OffPolicy:
    """`learner.is_correction` and `is_cap`, and this rank's mismatch sums since `take`."""

    def __init__(self, correction: str, cap: float, device: torch.device):
        if correction not in CORRECTIONS:
            raise ValueError(f"unknown is_correction {correction!r} (have {CORRECTIONS})")
        self.correction, self.cap = correction, float(cap)
        # [Σ |diff|, Σ ratio, truncated count], max ratio, −min ratio (one max-reduce later)
        self._sums = torch.zeros(3, dtype=torch.float64, device=device)
        self._max = torch.full((2,), -torch.inf, dtype=torch.float64, device=device)
        self._tokens = 0

    def weights(self, logp: torch.Tensor, behaviour: list[float]) -> torch.Tensor | None:
        """ρ_t for the scored log-probs `logp` (None: weight 1, no behaviour log-probs or no
        correction); records the mismatch either way. No host sync."""
        if not behaviour:
            return None
        if len(behaviour) != logp.numel():  # the callers' alignment, not the source's
            raise RuntimeError(f"{len(behaviour)} behaviour log-probs for {logp.numel()} "
                               f"scored tokens")
        b = upload(behaviour, torch.float64, logp.device)
        rho, ratio = truncated_ratio(logp, b, self.cap)
        if ratio.numel():
            diff = (logp.detach().to(torch.float64) - b).abs().sum()
            cut = (ratio > self.cap).sum(dtype=torch.float64)
            self._sums += torch.stack([diff, ratio.sum(), cut])
            self._max = torch.maximum(self._max, torch.stack([ratio.max(), -ratio.min()]))
            self._tokens += ratio.numel()
        return rho.to(logp.dtype) if self.correction == "tis" else None

    def reset(self) -> None:
        self._sums.zero_()
        self._max.fill_(-torch.inf)
        self._tokens = 0

    def take(self) -> tuple[list[float], list[float], int]:
        """(sums, maxima, tokens) since the last call, and reset (one host sync): sums =
        [Σ |diff|, Σ ratio, truncated], maxima = [max ratio, −min ratio]."""
        out = self._sums.tolist(), self._max.tolist(), self._tokens
        self.reset()
        return out


def mismatch(sums: list[float], maxima: list[float], tokens: int) -> MismatchStats:
    """MismatchStats from `take`'s figures (summed and max-reduced over DP ranks)."""
    if not tokens:
        return MismatchStats()
    return MismatchStats(mismatch_tokens=int(tokens), logprob_diff_sum=sums[0],
                         is_weight_sum=sums[1], truncated=int(sums[2]),
                         is_weight_max=maxima[0], is_weight_min=-maxima[1])


def weighted_logp_sum(logp: torch.Tensor, rho: torch.Tensor | None) -> torch.Tensor:
    """Σ_t ρ_t·log π_θ(a_t) (Σ_t log π_θ when ρ is None: on-policy, bit-identical)."""
    return logp.sum() if rho is None else (rho * logp).sum()
