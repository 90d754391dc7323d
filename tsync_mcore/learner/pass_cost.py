"""Streaming's cost model for pair passes (learner.pack_arrivals, GRPO).

A pair pass (members of a group whose rewards are not all known, folded into its G1'/G2)
costs more than the same sources' share of a packed direct pass. Near the end of the
rollout it can pay to wait and pack instead: this keeps what a pair pass costs beyond its
share, the last packed pass's rate, and when the previous batch's last source arrived.
Off unless the live trainer turns it on: replays and tests that serve a batch twice must
not depend on how fast they ran.
"""

from __future__ import annotations


class PassCost:
    def __init__(self) -> None:
        self.on = False
        self.pair_overhead_s: float | None = None
        self.direct_s_per_token: float | None = None  # the last packed direct pass's rate
        self.arrivals_end: float | None = None  # trace time the last batch's last source came

    def pair_pays(self, now: float, kind: str) -> bool:
        """May the next pass be a pair pass? A pair pass of p seconds started at t, when the
        last source is expected at E (the previous batch's), delays the packed pass after
        the rollout by max(0, t + p − E) and takes its sources' share q out of it: it pays
        unless t + p − E > q, i.e. unless t is within the pair pass's overhead p − q of E.
        Once E has passed unmet (a longer rollout), streaming resumes. Only trajectories
        (`kind`) hold pair passes that packing can replace."""
        if not self.on or kind != "trajectory" or self.pair_overhead_s is None or self.arrivals_end is None:
            return True
        return not (self.arrivals_end - self.pair_overhead_s < now < self.arrivals_end)

    def observe(self, fold: str, n_units: int, tokens: int, wall: float) -> None:
        """A pass of `n_units` units and `tokens` tokens took `wall` seconds."""
        if fold == "direct" and n_units > 1:
            self.direct_s_per_token = wall / max(tokens, 1)
        elif fold == "pair":  # unknown packed rate yet: the whole pass is overhead
            self.pair_overhead_s = max(0.0, wall - (self.direct_s_per_token or 0.0) * tokens)

    def batch_ended(self, records) -> None:
        """The batch's source records: when its last source arrived."""
        if records:
            self.arrivals_end = max(r.ready for r in records)
