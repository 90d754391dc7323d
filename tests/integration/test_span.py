"""K/V-span forward (tsync_mcore.model.span): exact logits and streamed gradients, TP=1/2, FLOPs.

The streamed gradient (per-span backward + reverse replay with the accumulated K/V adjoints)
is in tests/helpers/workers/span_worker.py, shared with the 2-rank launch.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.dist_util import run_dist
from tests.helpers.span_shared import (  # noqa: F401  (shared with the unit tests)
    FP32_FWD,
    FP32_GRAD,
    FP64_FWD,
    FP64_GRAD,
    NO_REPLAY_MIN,
    WORKER,
    sw,
)


@pytest.fixture(scope="module")
def tp2_results(tiny_ckpts):
    """One 2-rank launch (a launch costs ~8 s) for all TP=2 checks."""
    cfg = {"ckpts": {n: tiny_ckpts[n] for n in ("qwen2", "qwen3")}, "sdpa": ["qwen3"]}
    return run_dist([WORKER, json.dumps(cfg)], nproc=2, timeout=300)


def test_tp2_forward_and_streamed_grad(tp2_results):
    for r in tp2_results:
        assert r["tp_size"] == 2 and r["tp_rank"] == r["rank"]
        for name in ("qwen2", "qwen3", "qwen3_sdpa"):
            m = r[name]
            assert m["local_vocab"] == 128  # vocab-parallel logits
            assert m["fwd_fp64"] <= FP64_FWD and m["fwd_fp32"] <= FP32_FWD, (name, m)
            assert m["grad_fp64"] <= FP64_GRAD and m["grad_fp32"] <= FP32_GRAD, (name, m)
            assert m["grad_no_replay"] > NO_REPLAY_MIN, (name, m)
