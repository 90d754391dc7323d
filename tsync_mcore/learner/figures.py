"""The update's figures at close, over all DP ranks: the policy lag and the off-policy
mismatch of what trained, and the regularisers' KL (UpdateRecord's fields)."""

from __future__ import annotations

from tsync_mcore.learner.batch import BatchState
from tsync_mcore.objectives.off_policy import OffPolicy, mismatch
from tsync_mcore.objectives.regularizers import Regularizer


def lag_figures(policy, off_policy: OffPolicy, st: BatchState, dropped: list[str],
                scored: int) -> dict:
    """The policy-lag distribution of the scored tokens that trained, and the mismatch
    of every scored token served with a behaviour log-prob, over all DP ranks (TP ranks
    of a DP rank hold the same): one sum and one max all-reduce, one host read of the
    device sums (objectives/off_policy.py)."""
    trained = {k: r for k, r in st.records.items() if r.served and r.group_id not in dropped}
    sums, maxima, tokens = off_policy.take()
    lag_sum = sum(st.lag_sums[k] for k in trained)
    trained = trained.values()
    lagged = sum(r.lagged_tokens for r in trained)
    lag_max = max((r.policy_lag for r in trained if r.scored_tokens), default=0)
    s = policy.dp_sum_vector([lag_sum, lagged, tokens, *sums])
    mx = policy.dp_max_vector([lag_max, *maxima])
    return dict(policy_lag_mean=s[0] / scored if scored else 0.0, policy_lag_max=int(mx[0]),
                lagged_token_share=s[1] / scored if scored else 0.0,
                **mismatch(s[3:], mx[1:], int(s[2])).means())


def regularizer_figures(policy, reg: Regularizer, reference, st: BatchState) -> dict:
    """The KL estimator's mean over the scored tokens served with it (over DP ranks),
    the reference's bytes on this rank. A group dropped after some of its members ran
    still counts their tokens here (what was computed, not what trained)."""
    if not reg.active:
        return {}
    s = policy.dp_sum_vector([float(st.kl), float(st.kl_tokens)])
    out = dict(kl_mean=s[0] / s[1] if s[1] and reg.kl_coef else None)
    if reference is not None:
        out["reference_bytes"] = reference.nbytes
    return out
