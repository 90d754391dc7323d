"""Shared by the tests of tracking: tests/unit/test_tracking.py,
tests/integration/test_tracking.py."""

from __future__ import annotations

from tsync_mcore.observability.tracking import Tracker


# Two updates' records as the learner writes them (flat keys), plus rollout-side '/' keys.
RECORDS = [
    dict(step=1, policy_version=0, ok=True, schedule="thundersync", step_wall_time_s=1.25,
         rollout_time_s=0.75, learner_tail_s=0.125, publish_time_s=0.0625, mfu_active=0.0123,
         tokens_per_s_per_device=456.5, tokens=913, peak_mem_bytes=3 * 2**30,
         reward_mean=0.5, response_length_mean=11.5, response_length_max=17,
         response_length_min=0, entropy=5.25, lr=1e-5, grad_norm=0.875,
         peak_mem_bytes_per_rank=[1, 2], memory={"backend": "cpu"}, nvml=None,
         **{"reward/format": 0.25, "eval/pass@k": 0.5, "eval/skipped": True}),
    dict(step=2, policy_version=1, ok=True, step_wall_time_s=2.5, rollout_time_s=1.5,
         learner_tail_s=0.25, publish_time_s=0.125, mfu_active=0.0246,
         tokens_per_s_per_device=228.25, tokens=913, peak_mem_bytes=2**30, reward_mean=None,
         response_length_mean=12.0, response_length_max=18, response_length_min=1,
         entropy=5.0, grad_norm=1.75, **{"reward/format": 0.5}),
]


def expected(record: dict) -> dict[str, float]:
    """The tracker scalars written out by hand from docs/guide/metrics.md (independent of the table)."""
    out = {"timing_s/step": record["step_wall_time_s"], "timing_s/rollout": record["rollout_time_s"],
           "timing_s/learner_tail": record["learner_tail_s"],
           "timing_s/publish": record["publish_time_s"], "perf/mfu": record["mfu_active"],
           "perf/throughput": record["tokens_per_s_per_device"],
           "perf/total_num_tokens": record["tokens"],
           "perf/max_memory_allocated_gb": record["peak_mem_bytes"] / 1024**3,
           "response_length/mean": record["response_length_mean"],
           "response_length/max": record["response_length_max"],
           "response_length/min": record["response_length_min"],
           "actor/entropy": record["entropy"], "actor/grad_norm": record["grad_norm"],
           "reward/format": record["reward/format"]}
    if record["reward_mean"] is not None:
        out["reward/mean"] = record["reward_mean"]
    if "lr" in record:
        out["actor/lr"] = record["lr"]
    if "eval/pass@k" in record:
        out["eval/pass@k"] = record["eval/pass@k"]
    return out


def log_all(tracker: Tracker) -> None:
    for r in RECORDS:
        tracker.log(r, step=r["step"])
    tracker.log(dict(step=2, policy_version=2, ok=False, skipped="non-finite"), step=2)
    tracker.finish()
