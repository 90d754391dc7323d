"""FLOP ledger for LoRA policies: exact against FlopCounterMode on an independent model, the
Hugging Face checkpoint wrapped with `peft` (separate q/k/v modules, FP64); arithmetic of the
adapters' own products and of their TP split."""

from __future__ import annotations

from tsync_mcore.observability.ledger import LoraShape, load_spec, train_flops
from tsync_mcore.observability.ledger.flops import LORA_TARGETS
from tsync_mcore.observability.ledger.sizes import adapter_params, model_params


def test_lora_per_rank_equal_counter_tp2(tiny_ckpts):
    """At TP = 2 each rank executes the split base and adapter products / 2 and the
    replicated adapter products whole (`FlopBreakdown.per_rank`)."""
    import json

    from tests.helpers.dist_util import run_dist

    targets = list(LORA_TARGETS)
    ckpts = {"qwen3": tiny_ckpts["qwen3"]}
    cfg = {"tp": 2, "ckpts": ckpts, "seq_lens": [[9], [48, 31]],
           "lora": {"rank": 4, "targets": targets}}
    ranks = run_dist(["tests/helpers/workers/ledger_worker.py", json.dumps(cfg)], nproc=2)
    spec = load_spec(ckpts["qwen3"])
    for rank in ranks:
        for r in rank["results"]["qwen3"]:
            b = train_flops(spec, r["seq_lens"], lora=LoraShape(4, tuple(targets)))
            one = b.per_rank(2)
            assert (one.forward, one.total) == (r["forward"], r["total"]), (rank["tp_rank"], r)
            # the sizes tool's per-rank counts are what a rank holds
            assert adapter_params(spec, 4, targets, tp=2) == r["adapter_params"]
            assert model_params(spec, tp=2) + adapter_params(spec, 4, targets, tp=2) == \
                r["params"]
