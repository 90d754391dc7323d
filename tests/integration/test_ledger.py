"""Measurement layer: FLOP ledger vs FlopCounterMode on the real model (LoRA policies too),
MFU, NVML, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.ledger_shared import TOL, check, rel  # noqa: F401  (shared with the unit tests)
from tests.helpers.paths import ROOT as REPO_ROOT
import pytest

from tsync_mcore.observability.ledger import (
    LoraShape,
    load_spec,
    train_flops,
)
from tsync_mcore.observability.ledger.flops import LORA_TARGETS
from tsync_mcore.observability.ledger.sizes import adapter_params, model_params
from tsync_mcore.observability.ledger.__main__ import main as cli_main


LORA_TARGETS_ALL = list(LORA_TARGETS)
SEQ_LENS = [[9], [48, 31]]


@pytest.fixture(scope="module")
def tp2_ranks(tiny_ckpts):
    """One 2-rank launch counting FlopCounterMode on the Megatron model at TP = 2: the
    freeze cases of qwen3 and llama_tied (job 0) and a LoRA qwen3 (job 1)."""
    from tests.helpers.dist_util import run_dist

    cfg = {"tp": 2, "jobs": [
        {"ckpts": {n: tiny_ckpts[n] for n in ("qwen3", "llama_tied")}, "seq_lens": SEQ_LENS},
        {"ckpts": {"qwen3": tiny_ckpts["qwen3"]}, "seq_lens": SEQ_LENS,
         "lora": {"rank": 4, "targets": LORA_TARGETS_ALL}}]}
    ranks = run_dist(["tests/helpers/workers/ledger_worker.py", json.dumps(cfg)], nproc=2)
    assert [r["tp_size"] for r in ranks] == [2, 2]
    return ranks


def test_train_flops_match_counter_tp2(tiny_ckpts, tp2_ranks):
    ranks = tp2_ranks
    for name in ("qwen3", "llama_tied"):
        spec = load_spec(tiny_ckpts[name])
        for rank in ranks:
            check(rank["jobs"][0][name], spec, tp=2)
        # the TP group together executes the whole-model figure
        for r0, r1 in zip(ranks[0]["jobs"][0][name], ranks[1]["jobs"][0][name]):
            whole = train_flops(spec, r0["seq_lens"], frozen=r0["frozen"]).total
            assert rel(whole, r0["total"] + r1["total"]) < TOL


def test_lora_per_rank_equal_counter_tp2(tiny_ckpts, tp2_ranks):
    """LoRA policies at TP = 2 (the rest of their checks: tests/unit/test_ledger_lora.py):
    each rank executes the split base and adapter products / 2 and the replicated adapter
    products whole (`FlopBreakdown.per_rank`)."""
    targets = LORA_TARGETS_ALL
    spec = load_spec(tiny_ckpts["qwen3"])
    for rank in tp2_ranks:
        for r in rank["jobs"][1]["qwen3"]:
            b = train_flops(spec, r["seq_lens"], lora=LoraShape(4, tuple(targets)))
            one = b.per_rank(2)
            assert (one.forward, one.total) == (r["forward"], r["total"]), (rank["tp_rank"], r)
            # the sizes tool's per-rank counts are what a rank holds
            assert adapter_params(spec, 4, targets, tp=2) == r["adapter_params"]
            assert model_params(spec, tp=2) + adapter_params(spec, 4, targets, tp=2) == \
                r["params"]


def test_cli_json_and_text(tiny_qwen2, capsys):
    out = subprocess.run(
        [sys.executable, "-m", "tsync_mcore.observability.ledger", "--model", tiny_qwen2,
         "--seq-lens", "128,512", "--scored", "64,500", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = train_flops(load_spec(tiny_qwen2), [128, 512], logits_positions=[64, 500])
    assert got["forward_flops"] == want.forward
    assert got["backward_flops"] == want.backward
    assert got["total_flops"] == want.total == got["forward_flops"] + got["backward_flops"]
    assert cli_main(["--model", tiny_qwen2, "--seq-lens", "16", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "forward_flops" in text and "total_flops" in text and "tp=2" in text
