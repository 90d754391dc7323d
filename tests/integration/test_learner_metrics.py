"""The learner's per-update metrics: entropy of the scored tokens (TP=1 in process; TP=2 on
two ranks in tests/integration/test_lm_head.py's launch) against an FP64 full-softmax
reference on the HF model, and a live run (learner ranks + scripted rollout) whose
metrics.jsonl, console lines and TensorBoard events hold the response lengths, tokens and
entropy of the batches it trained on."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.batchgen import make_batch
from tests.helpers.entropy_shared import ENT_TOL, VOCAB, entropy_rows, reference_entropy


@pytest.fixture(scope="module")
def rows():
    return entropy_rows()


def test_entropy_tp1(tiny_qwen2, parallel1, rows):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    policy = Policy(load_config(None, {"model.hf_dir": tiny_qwen2}), par=parallel1)
    for r in rows:
        policy.backward_source(r["tokens"], r["scored_mask"], 1.0)
        policy.zero_grads()
    ent_sum, n = policy.take_entropy()
    ref_sum, ref_n = reference_entropy(tiny_qwen2, rows)
    assert n == ref_n == sum(sum(r["scored_mask"]) for r in rows)
    assert abs(ent_sum / n - ref_sum / ref_n) <= ENT_TOL
    assert policy.take_entropy() == (0.0, 0)  # taken: reset for the next update


def test_live_run_metrics(tiny_qwen2, golden):
    # the shared live run (conftest.py): loggers console, jsonl and tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    updates, run, published, out = 2, golden["run"], golden["published"], golden["out"]
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2]
    acc = EventAccumulator(os.path.join(run, "tensorboard"))
    acc.Reload()
    console = [l for l in out.splitlines() if l.startswith("step:")]
    assert len(console) == updates and sum(l.startswith("STEP ") for l in out.splitlines()) == 2
    for k, m in enumerate(metrics):
        batch = make_batch(VOCAB, n_groups=3, m=3, version=k, seed=1)  # what test_e2e sends
        lengths = [sum(r["scored_mask"]) for r in batch]
        assert m["response_length_mean"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-12)
        assert (m["response_length_max"], m["response_length_min"]) == (max(lengths), min(lengths))
        # tokens the learner forwarded: prompt + response of every trajectory it scored
        assert m["tokens"] == sum(len(r["tokens"]) for r in batch if any(r["scored_mask"]))
        assert m["tokens_per_s_per_device"] == pytest.approx(
            m["tokens"] / (m["step_wall_time_s"] * 2), rel=1e-12)
        ref_sum, ref_n = reference_entropy(tiny_qwen2, batch, published[k])  # θ_k sampled it
        assert abs(m["entropy"] - ref_sum / ref_n) <= ENT_TOL
        for name, key in [("response_length/mean", "response_length_mean"),
                          ("actor/entropy", "entropy"), ("actor/grad_norm", "grad_norm"),
                          ("timing_s/step", "step_wall_time_s"), ("perf/mfu", "mfu_active"),
                          ("perf/throughput", "tokens_per_s_per_device")]:
            events = {e.step: e.value for e in acc.Scalars(name)}
            assert events[k + 1] == pytest.approx(m[key], rel=1e-6), name
        # on-policy and no behaviour log-probs sent: no lag, no mismatch figures
        assert (m["policy_lag_mean"], m["policy_lag_max"], m["lagged_token_share"]) == (0, 0, 0)
        assert m["mismatch_tokens"] == 0 and m["is_weight_mean"] is None
        # the fused LM head's estimated peak (docs/design/lm-head.md), per rank and the largest
        assert m["head_peak_bytes"] == max(m["head_peak_bytes_per_rank"]) > 0
        fields = dict(f.split(":", 1) for f in console[k].split(" - "))
        assert int(fields["step"]) == k + 1
        assert float(fields["response_length/max"]) == max(lengths)
