"""Megatron-Core model layer: HF <-> GPTModel conversion, TP=1 and TP=2 (2 gloo ranks), and
the K/V-span forward at TP=2 (tsync_mcore.model.span) in the same launch."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.dist_util import run_dist
from tests.helpers.model_shared import FP32_TOL  # noqa: F401  (shared with the unit tests)
from tests.helpers.paths import WORKERS
from tests.helpers.span_shared import FP32_FWD, FP32_GRAD, FP64_FWD, FP64_GRAD, NO_REPLAY_MIN

WORKER = os.path.join(WORKERS, "model_worker.py")


@pytest.fixture(scope="module")
def dist_results(tiny_ckpts, tmp_path_factory):
    """One 2-rank launch running all multi-rank checks (a launch costs ~8 s)."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    bad = make_tiny_checkpoint(str(tmp_path_factory.mktemp("bad_vocab")), vocab_size=255)
    cfg = {"tp2": {"ckpts": tiny_ckpts, "bad_vocab": bad}, "dp2": {"ckpt": tiny_ckpts["qwen2"]},
           "span": {"ckpts": {n: tiny_ckpts[n] for n in ("qwen2", "qwen3")}, "sdpa": ["qwen3"]}}
    return run_dist([WORKER, json.dumps(cfg)], nproc=2, timeout=400)


def test_tp2_span_forward_and_streamed_grad(dist_results):
    """K/V-span forward (tsync_mcore.model.span) at TP = 2, in this launch: exact logits and
    streamed gradients (the rest: tests/unit/test_span.py)."""
    for r in dist_results:
        span = r["span"]
        assert span["tp_size"] == 2 and span["tp_rank"] == r["rank"]
        for name in ("qwen2", "qwen3", "qwen3_sdpa"):
            m = span[name]
            assert m["local_vocab"] == 128  # vocab-parallel logits
            assert m["fwd_fp64"] <= FP64_FWD and m["fwd_fp32"] <= FP32_FWD, (name, m)
            assert m["grad_fp64"] <= FP64_GRAD and m["grad_fp32"] <= FP32_GRAD, (name, m)
            assert m["grad_no_replay"] > NO_REPLAY_MIN, (name, m)


def test_tp2_logits_match_hf(dist_results, tiny_ckpts):
    for r in dist_results:
        tp2 = r["tp2"]
        assert tp2["tp_size"] == 2 and tp2["tp_rank"] == r["rank"]
        for name in tiny_ckpts:
            assert tp2[name]["local_vocab"] == 128
            assert tp2[name]["logits_err"] <= FP32_TOL, (name, tp2[name])
        assert tp2["tp_streams_differ"] and tp2["dp_streams_equal"]


def test_tp2_export_grads_match_hf(dist_results, tiny_ckpts):
    """export_hf maps TP-sharded gradients like parameters (gathered, un-interleaved)."""
    for r in dist_results:
        for name in tiny_ckpts:
            assert r["tp2"][name]["grad_names_ok"], name
            assert r["tp2"][name]["grad_rel_err"] <= 1e-4, (name, r["tp2"][name])
            # pre-sync grads with tp_partial_grads=True == grads after finish_grad_sync
            assert r["tp2"][name]["raw_grads_equal_synced"], name


def test_tp2_export_round_trip(dist_results, tiny_ckpts):
    for r in dist_results:
        for name in tiny_ckpts:
            assert r["tp2"][name]["export_names_equal"], name
            assert r["tp2"][name]["export_exact"], name
        assert r["tp2"]["bf16_export_exact"]


def test_tp2_bad_vocab_error(dist_results):
    for r in dist_results:
        msg = r["tp2"]["bad_vocab_error"]
        assert msg is not None and "vocab_size 255" in msg and "tensor-parallel size 2" in msg


@pytest.mark.parametrize("case", ["fp32_allreduce", "fp32_distopt", "bf16_distopt"])
def test_dp2_grad_sum_and_optimizer_step(dist_results, case):
    """Different sequences per rank; the reduced grads are the SUM of the ranks' grads."""
    for r in dist_results:
        assert r["dp2"]["dp_size"] == 2 and r["dp2"]["dp_rank"] == r["rank"]
        c = r["dp2"][case]
        assert c["grad_dtypes"] == ["torch.float32"]  # flat FP32 buffers, bf16 models too
        want = "torch.bfloat16" if case.startswith("bf16") else "torch.float32"
        assert c["param_dtypes"] == [want]
        assert c["flat_numel"] >= c["n_params"]
        assert c["sum_err"] == 0.0  # sum of the pre-sync buffers, not a mean
        if case.startswith("fp32"):
            # vs both sequences recomputed on one rank
            assert c["ref_err"] <= 1e-5 * c["ref_scale"]
            assert abs(c["grad_norm"] - c["ref_norm"]) <= 1e-5 * c["ref_norm"]
            assert c["adam_err"] <= 1e-6  # vs torch Adam + clip_grad_norm_ on summed grads
        else:
            assert c["ref_err"] <= 0.05 * c["ref_scale"]
            assert abs(c["grad_norm"] - c["ref_norm"]) <= 0.02 * c["ref_norm"]
        assert c["ok"] and c["changed"] and c["same_across_ranks"]
