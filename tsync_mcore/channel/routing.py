"""Which learner rank serves a finished trajectory (rollout side).

    static     each GRPO group goes to its `assign_groups` owner, fixed at registration
               (and every OPD trajectory with its group);
    balanced   each GRPO trajectory goes, when it finishes, to the data-parallel rank with
               the least work assigned so far in the batch (its tokens as the cost). Members
               of one group may land on different ranks: the rollout then announces the
               group's rewards to the ranks that hold its members (GroupRewards) once the
               last one finishes, and each rank folds its members with the group's
               statistics. The sum over
               ranks is the same g_G (G1'/G2 and the advantages are linear in the members).

Why per trajectory: completion times and lengths are random, so a fixed group → rank map
leaves one rank with more of the late, long trajectories and the other idle at the end.
Least-assigned needs no feedback from the learners and is what a streaming learner wants
too: in a simulation of the paper's release model it did as well as join-the-shortest-queue
with known service times (figures: docs/measured/overlap-2026-11-30.md, "Routing").
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTINGS = ("static", "balanced")


@dataclass(frozen=True)
class Routed:
    rank: int  # the DP rank that serves this trajectory
    # When it was its group's last member and the group is split over several ranks: the
    # group's rewards, for `announce_to` (the DP ranks that hold some of its members).
    rewards: dict[str, float] | None = None
    announce_to: tuple[int, ...] = ()


class BalancedRouter:
    """Balanced routing of one GRPO batch, with the bookkeeping for its announcements."""

    def __init__(self, groups: dict[str, list[str]], n_ranks: int):
        if n_ranks < 1:
            raise ValueError(f"need at least one rank, got {n_ranks}")
        self.groups = groups
        self.assigned = [0] * n_ranks  # cost (tokens) given to each rank in this batch
        self.rewards: dict[str, dict[str, float]] = {}
        self.holders: dict[str, set[int]] = {}

    def route(self, traj_id: str, group_id: str, reward: float, cost: int) -> Routed:
        rank = min(range(len(self.assigned)), key=lambda i: (self.assigned[i], i))
        self.assigned[rank] += cost
        done = self.rewards.setdefault(group_id, {})
        done[traj_id] = float(reward)
        holders = self.holders.setdefault(group_id, set())
        holders.add(rank)
        if len(done) < len(self.groups[group_id]) or len(holders) == 1:
            return Routed(rank)  # a group served on one rank completes there by itself
        return Routed(rank, dict(done), tuple(sorted(holders)))
