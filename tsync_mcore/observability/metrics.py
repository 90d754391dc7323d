"""Per-update metrics: what metrics.jsonl holds and what the trackers are sent.

metrics.jsonl keeps the learner's own flat keys (report, predict and the launchers read them);
the trackers get the scalar ones under the names verl users know, through TRACKER_NAMES,
plus every key that already has a '/' in it (e.g. `reward/<extra>`, `eval/pass@k` from the
rollout). docs/guide/metrics.md documents each row.

The learner-side statistics (response length, tokens, entropy) are summed per DP rank from
its trace and the policy's entropy sums, then combined over DP ranks by `reduce_stats`.
"""

from __future__ import annotations

import math
from typing import Iterable

from tsync_mcore.observability.trace import Record, SourceRecord, UpdateRecord

# metrics.jsonl key → (tracker name, factor applied to the value).
TRACKER_NAMES: dict[str, tuple[str, float]] = {
    "step_wall_time_s": ("timing_s/step", 1.0),
    "rollout_time_s": ("timing_s/rollout", 1.0),
    "learner_tail_s": ("timing_s/learner_tail", 1.0),
    "publish_time_s": ("timing_s/publish", 1.0),
    "mfu_active": ("perf/mfu", 1.0),
    "tokens_per_s_per_device": ("perf/throughput", 1.0),
    "tokens": ("perf/total_num_tokens", 1.0),
    "peak_mem_bytes": ("perf/max_memory_allocated_gb", 1.0 / 2**30),
    "reward_mean": ("reward/mean", 1.0),
    "response_length_mean": ("response_length/mean", 1.0),
    "response_length_max": ("response_length/max", 1.0),
    "response_length_min": ("response_length/min", 1.0),
    "entropy": ("actor/entropy", 1.0),
    "kl_mean": ("actor/kl", 1.0),  # learner.kl_coef > 0 (verl: actor/kl_loss)
    "filtered_groups": ("batch/filtered_groups", 1.0),  # learner.filter_groups
    # learner.minibatches > 1: verl's names
    "pg_clipfrac": ("actor/pg_clipfrac", 1.0),
    "pg_clipfrac_lower": ("actor/pg_clipfrac_lower", 1.0),
    "ppo_kl": ("actor/ppo_kl", 1.0),
    "lr": ("actor/lr", 1.0),
    "grad_norm": ("actor/grad_norm", 1.0),
    # off-policy figures (docs/design/async.md#off-policy-correction-and-the-lag-and-mismatch-figures): the same keys under one prefix
    **{k: (f"off_policy/{k}", 1.0) for k in (
        "policy_lag_mean", "policy_lag_max", "lagged_token_share", "logprob_diff_mean",
        "is_weight_mean", "is_weight_max", "is_weight_min", "is_truncated_share",
        "is_dropped_share")},
}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def tracker_scalars(record: dict) -> dict[str, float]:
    """The scalars of one metrics.jsonl record under their tracker names (None: left out)."""
    out = {}
    for key, (name, factor) in TRACKER_NAMES.items():
        v = record.get(key)
        if _number(v):
            out[name] = float(v) * factor
    for key, v in record.items():
        if "/" in key and _number(v):
            out[key] = float(v)
    return out


# --- learner-side statistics ------------------------------------------------------------

# One row per DP rank; summed (or max/min-ed) over ranks by reduce_stats.
STAT_FIELDS = ("trajectories", "length_sum", "length_max", "length_min", "tokens",
               "entropy_sum", "entropy_tokens")


def trajectory_lengths(records: Iterable[Record],
                       dropped: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """traj_id → (scored tokens, tokens) of the trajectories served here and trained on.

    A GRPO trajectory is one source, or one per segment (a rewritten history: summed); an
    OPD trajectory's turns are summed. Tokens is the furthest position forwarded (context +
    span: prompt and response, shared prompt too), summed over segments."""
    left_out = set(dropped)
    parts: dict[tuple[str, int | None], tuple[int, int]] = {}
    for r in records:
        if isinstance(r, SourceRecord) and r.served and r.group_id not in left_out:
            key = (r.traj_id, r.segment)
            scored, tokens = parts.get(key, (0, 0))
            parts[key] = (scored + r.scored_tokens, max(tokens, r.context + r.span_tokens))
    out: dict[str, tuple[int, int]] = {}
    for (t, _), (scored, tokens) in parts.items():
        s0, t0 = out.get(t, (0, 0))
        out[t] = (s0 + scored, t0 + tokens)
    return out


def local_stats(records: Iterable[Record], dropped: Iterable[str],
                entropy_sum: float, entropy_tokens: int) -> list[float]:
    """This DP rank's row of STAT_FIELDS."""
    lengths = trajectory_lengths(records, dropped)
    scored = [s for s, _ in lengths.values()]
    return [float(len(scored)), float(sum(scored)), float(max(scored, default=0)),
            float(min(scored, default=0)), float(sum(t for _, t in lengths.values())),
            float(entropy_sum), float(entropy_tokens)]


def reduce_stats(rows: Iterable[list[float]]) -> dict:
    """metrics.jsonl keys from every DP rank's row (a rank with no row may send zeros)."""
    rows = [dict(zip(STAT_FIELDS, r)) for r in rows]
    served = [r for r in rows if r["trajectories"] > 0]
    n = sum(r["trajectories"] for r in served)
    ent_n = sum(r["entropy_tokens"] for r in rows)
    return dict(
        response_length_mean=sum(r["length_sum"] for r in served) / n if n else None,
        response_length_max=int(max(r["length_max"] for r in served)) if n else None,
        response_length_min=int(min(r["length_min"] for r in served)) if n else None,
        tokens=int(sum(r["tokens"] for r in rows)),
        entropy=sum(r["entropy_sum"] for r in rows) / ent_n if ent_n else None,
    )


# The policy-lag distribution and the rollout/learner mismatch of an update, as its
# UpdateRecord carries them (reduced over DP ranks by the learner's close).
OFF_POLICY_FIELDS = ("policy_lag_mean", "policy_lag_max", "lagged_token_share",
                     "mismatch_tokens", "logprob_diff_mean", "is_weight_mean", "is_weight_max",
                     "is_weight_min", "is_truncated_share", "is_dropped_share")


def off_policy_metrics(update: UpdateRecord) -> dict:
    """metrics.jsonl keys of the update's lag and mismatch figures (None: no token had a
    behaviour log-prob), its KL to the reference (learner.kl_coef > 0) and its PPO
    mini-batch figures (learner.minibatches > 1)."""
    return {**{k: getattr(update, k) for k in OFF_POLICY_FIELDS + UPDATE_EXTRAS}}


# The learner's other per-update figures that metrics.jsonl carries as they are
UPDATE_EXTRAS = ("kl_mean", "reference_bytes", "minibatch_steps", "pg_clipfrac",
                 "pg_clipfrac_lower", "ppo_kl")


def throughput(tokens: int, step_s: float, n_devices: int) -> float | None:
    """verl's perf/throughput: tokens per second per learner device."""
    if step_s <= 0 or n_devices < 1 or not math.isfinite(step_s):
        return None
    return tokens / (step_s * n_devices)
