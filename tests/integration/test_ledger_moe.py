"""FLOP ledger for mixture-of-experts layers: exact against FlopCounterMode on an independent
model, Hugging Face `Qwen3MoeForCausalLM` (eager attention, eager experts loop, FP64), with the
routing recorded from that forward by `RoutingCounter`; arithmetic and refusals of the MoE
parts; the counter on Megatron-Core's own TopKRouter."""

from __future__ import annotations

import json

import pytest

from tsync_mcore.observability.ledger import train_flops


def test_ep_rank_flops_equal_counter_on_each_rank(tiny_qwen3_moe):
    """EP = 2 on 2 gloo ranks, a different batch on each: a rank runs attention, router and
    head on its own tokens and its 2 experts on both ranks' tokens routed to them."""
    from tests.helpers.dist_util import run_dist
    from tsync_mcore.observability.ledger import ep_rank_flops, load_spec

    cfg = {"ckpt": tiny_qwen3_moe, "shapes": [[1, 19], [2, 11]]}
    ranks = run_dist(["tests/helpers/workers/ledger_moe_ep_worker.py", json.dumps(cfg)], nproc=2)
    spec = load_spec(tiny_qwen3_moe)
    assert [r["local_experts"] for r in ranks] == [2, 2]
    lens, routing = [r["seq_lens"] for r in ranks], [r["routing"] for r in ranks]
    for k, r in enumerate(ranks):
        b = ep_rank_flops(spec, lens, routing, k, attention=r["attention"])
        assert (b.forward, b.total) == (r["forward"], r["total"])
        # not the rank's own tokens through every expert: its experts' load is the group's
        assert b.total != train_flops(spec, lens[k], attention=r["attention"]).total
    # the group together executes the model FLOPs of all its sequences
    whole = train_flops(spec, lens[0] + lens[1], attention=ranks[0]["attention"])
    assert sum(r["total"] for r in ranks) == whole.total
    with pytest.raises(ValueError, match="one routing per EP rank"):
        ep_rank_flops(spec, lens, routing[:1], 0)
