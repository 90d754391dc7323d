"""Token normalisation (`learner.token_norm`): how a batch's scored tokens are weighted.

The update is g_k = Σ_G Σ_{i∈G} Σ_{t∈M_i} c_{G,i} · A_i ∇ log π(a_t | h_t), and each mode's
per-token coefficient c factors into three parts, each applied where it is first known:

    c = w(L_i)          at the source, before its backward (L_i: its scored tokens)
      · (1/m_G or 1)    at the group's fold/close: `group_mean` keeps the group mean
      · 1/D             at batch close, a deferred scalar over what trains (D below)

| mode                      | w(L_i) | 1/m_G | D        | c per token           |
|---------------------------|--------|-------|----------|-----------------------|
| `trajectory`              | 1/L_i  | yes   | n_groups | 1/(n_groups·m_G·L_i)  |
| `group_scaled_token_mean` | 1      | yes   | N_k      | 1/(m_G·N_k)           |
| `token_mean`              | 1      | no    | N_k      | 1/N_k                 |
| `seq_mean_token_mean`     | 1/L_i  | no    | B        | 1/(B·L_i)             |
| `seq_mean_token_sum_norm` | 1      | no    | B·H      | 1/(B·H)               |

n_groups: groups that train; B: trajectories of those groups (all registered members,
also those with no scored token); N_k: their scored tokens, summed over DP ranks; H:
`learner.token_norm_constant`. n_groups and B follow from the plan and the dropped groups,
the same on every rank; N_k is one all-reduce at close. So every mode is exact under every
schedule and routing: nothing in c depends on which rank or when a member was served.
A turn source (OPD) trains before its trajectory's L_i is known and has no group
advantage, so only the modes with w = 1 and no 1/m_G run there. docs/design/objectives.md maps
each mode to verl's `loss_agg_mode` and TRL's `loss_type`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenNorm:
    name: str
    per_trajectory: bool  # w = 1/L_i at the source (needs the whole trajectory's length)
    group_mean: bool  # keep the 1/m_G of the group direction (each group weighted equally)
    divisor: str  # "groups", "tokens", "trajectories" or "trajectories·H": D at close

    def source_weight(self, n_scored: int) -> float:
        return 1.0 / n_scored if self.per_trajectory else 1.0

    def batch_scale(self, n_groups: int, n_trajectories: int, n_tokens: int,
                    constant: float) -> float:
        """1/D over what trains in the batch (0 when nothing does)."""
        d = {"groups": n_groups, "tokens": n_tokens, "trajectories": n_trajectories,
             "trajectories·H": n_trajectories * constant}[self.divisor]
        return 1.0 / d if d else 0.0


TOKEN_NORMS: dict[str, TokenNorm] = {n.name: n for n in [
    TokenNorm("trajectory", per_trajectory=True, group_mean=True, divisor="groups"),
    TokenNorm("group_scaled_token_mean", per_trajectory=False, group_mean=True, divisor="tokens"),
    TokenNorm("token_mean", per_trajectory=False, group_mean=False, divisor="tokens"),
    TokenNorm("seq_mean_token_mean", per_trajectory=True, group_mean=False,
              divisor="trajectories"),
    TokenNorm("seq_mean_token_sum_norm", per_trajectory=False, group_mean=False,
              divisor="trajectories·H"),
]}

# Deprecated names → what they computed, per source kind. `global` meant "÷ N_k at close":
# for GRPO trajectories that came on top of the group mean (1/(m_G·N_k), not the 1/N_k the
# README said); for OPD turns, which have no group mean, it was exactly token_mean.
DEPRECATED = {"global": {"trajectory": "group_scaled_token_mean", "turn": "token_mean"}}

# The default per source kind (learner.token_norm: auto).
AUTO = {"trajectory": "trajectory", "turn": "token_mean"}


def streams_on(norm: TokenNorm, source: str) -> str | None:
    """Why `norm` cannot run on sources of kind `source`, or None when it can."""
    if source != "turn":
        return None
    if norm.per_trajectory:
        return ("needs each trajectory's scored length L_i before its first source trains; "
                "OPD streams turns")
    if norm.group_mean:
        return "weights each group by 1/m_G, which only GRPO-family advantages have"
    return None
