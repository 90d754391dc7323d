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

Beyond TIS (`learner.is_correction`, bounds `is_low` ≤ · ≤ `is_cap` = C; verl's
rollout_corr and slime's names in docs/design/objectives.md), each weight is as detached
and as fixed at the source's arrival:

    mis         ρ_t = r_t · 1[low ≤ r_t ≤ C]            (masked IS: tokens outside drop out)
    seq_tis     ρ_t = min(g, C)                           g = exp(mean_t log r_t), the
    seq_mis     ρ_t = g · 1[low ≤ g ≤ C]                  sequence's geometric-mean ratio
    seq_reject  ρ_t = 1[low ≤ g ≤ C]                      (the whole sequence kept or not)

A dropped token keeps its place in the token-norm denominators (weight 0, as an IS weight;
verl's rejection sampling renormalises instead). The sequence modes need every scored
token of a sequence in one forward: GRPO trajectories, not OPD's turns (refused there).

Whenever a source carries behaviour log-probs — correction on or off, any schedule — the
same pass adds to the mismatch statistics, kept on the device and read once per update
(`take`): Σ |log π_θ − log π_b|, and the raw ratio's sum, max and min, how many tokens
the cap truncates and how many the guard drops (weight 0). Off, they say what TIS would do; on a synchronous schedule they
measure the rollout/learner numerical difference alone (the ratio is 1 in exact math).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsync_mcore.platform import upload

CORRECTIONS = ("none", "tis", "mis", "seq_tis", "seq_mis", "seq_reject")
SEQUENCE_MODES = ("seq_tis", "seq_mis", "seq_reject")


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


def guard(mode: str, log_ratio: torch.Tensor, low: float,
          cap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ρ per token, truncated per token, dropped per token) for one sequence's scored
    tokens, from log r_t = log π_θ − log π_b (float64, detached); the module doc's table."""
    ratio = torch.exp(log_ratio)
    if mode in SEQUENCE_MODES:
        g = torch.exp(log_ratio.mean()).expand_as(ratio) if ratio.numel() else ratio
        inside = (g >= low) & (g <= cap)
        if mode == "seq_tis":
            return g.clamp(max=cap), g > cap, torch.zeros_like(inside)
        rho = g if mode == "seq_mis" else torch.ones_like(g)
        return torch.where(inside, rho, torch.zeros_like(rho)), torch.zeros_like(inside), ~inside
    if mode == "mis":
        inside = (ratio >= low) & (ratio <= cap)
        return (torch.where(inside, ratio, torch.zeros_like(ratio)), torch.zeros_like(inside),
                ~inside)
    return ratio.clamp(max=cap), ratio > cap, torch.zeros_like(ratio, dtype=torch.bool)


@dataclass
class MismatchStats:
    """One update's figures over the scored tokens that carried behaviour log-probs."""

    mismatch_tokens: int = 0  # scored tokens with a behaviour log-prob
    logprob_diff_sum: float = 0.0  # Σ |log π_θ − log π_b|
    is_weight_sum: float = 0.0  # Σ π_θ/π_b (untruncated)
    is_weight_max: float | None = None
    is_weight_min: float | None = None
    truncated: int = 0  # tokens whose weight the cap truncated (tis, seq_tis)
    dropped: int = 0  # tokens the guard gave weight 0 (mis, seq_mis, seq_reject)

    def means(self) -> dict:
        """The UpdateRecord / metrics names (None where no token carried a log-prob)."""
        n = self.mismatch_tokens
        return dict(mismatch_tokens=n,
                    logprob_diff_mean=self.logprob_diff_sum / n if n else None,
                    is_weight_mean=self.is_weight_sum / n if n else None,
                    is_weight_max=self.is_weight_max if n else None,
                    is_weight_min=self.is_weight_min if n else None,
                    is_truncated_share=self.truncated / n if n else None,
                    is_dropped_share=self.dropped / n if n else None)


class OffPolicy:
    """`learner.is_correction` and `is_cap`, and this rank's mismatch sums since `take`."""

    def __init__(self, correction: str, cap: float, device: torch.device, low: float = 0.0):
        if correction not in CORRECTIONS:
            raise ValueError(f"unknown is_correction {correction!r} (have {CORRECTIONS})")
        self.correction, self.cap, self.low = correction, float(cap), float(low)
        # [Σ |diff|, Σ ratio, truncated, dropped], max ratio, −min ratio (one max-reduce later)
        self._sums = torch.zeros(4, dtype=torch.float64, device=device)
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
        log_ratio = logp.detach().to(torch.float64) - b
        mode = "tis" if self.correction == "none" else self.correction  # (what TIS would do)
        rho, cut, drop = guard(mode, log_ratio, self.low, self.cap)
        if log_ratio.numel():
            ratio = torch.exp(log_ratio)
            on = self.correction != "none"
            self._sums += torch.stack([log_ratio.abs().sum(), ratio.sum(),
                                       cut.sum(dtype=torch.float64),
                                       drop.sum(dtype=torch.float64) * on])
            self._max = torch.maximum(self._max, torch.stack([ratio.max(), -ratio.min()]))
            self._tokens += ratio.numel()
        return rho.to(logp.dtype) if self.correction != "none" else None

    def reset(self) -> None:
        self._sums.zero_()
        self._max.fill_(-torch.inf)
        self._tokens = 0

    def take(self) -> tuple[list[float], list[float], int]:
        """(sums, maxima, tokens) since the last call, and reset (one host sync): sums =
        [Σ |diff|, Σ ratio, truncated, dropped], maxima = [max ratio, −min ratio]."""
        out = self._sums.tolist(), self._max.tolist(), self._tokens
        self.reset()
        return out


def mismatch(sums: list[float], maxima: list[float], tokens: int) -> MismatchStats:
    """MismatchStats from `take`'s figures (summed and max-reduced over DP ranks)."""
    if not tokens:
        return MismatchStats()
    return MismatchStats(mismatch_tokens=int(tokens), logprob_diff_sum=sums[0],
                         is_weight_sum=sums[1], truncated=int(sums[2]), dropped=int(sums[3]),
                         is_weight_max=maxima[0], is_weight_min=-maxima[1])


def weighted_logp_sum(logp: torch.Tensor, rho: torch.Tensor | None) -> torch.Tensor:
    """Σ_t ρ_t·log π_θ(a_t) (Σ_t log π_θ when ρ is None: on-policy, bit-identical)."""
    return logp.sum() if rho is None else (rho * logp).sum()
