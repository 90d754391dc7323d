"""Measurement layer: FLOP ledger vs FlopCounterMode on the real model, MFU, NVML, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.ledger_shared import TOL, check, rel  # noqa: F401  (shared with the unit tests)
from tests.helpers.paths import ROOT as REPO_ROOT
from tsync_mcore.observability.ledger import (
    load_spec,
    train_flops,
)
from tsync_mcore.observability.ledger.__main__ import main as cli_main


def test_train_flops_match_counter_tp2(tiny_ckpts):
    from tests.helpers.dist_util import run_dist

    ckpts = {n: tiny_ckpts[n] for n in ("qwen3", "llama_tied")}
    cfg = {"tp": 2, "ckpts": ckpts, "seq_lens": [[9], [48, 31]]}
    ranks = run_dist(["tests/helpers/workers/ledger_worker.py", json.dumps(cfg)], nproc=2)
    assert [r["tp_size"] for r in ranks] == [2, 2]
    for name, path in ckpts.items():
        spec = load_spec(path)
        for rank in ranks:
            check(rank["results"][name], spec, tp=2)
        # the TP group together executes the whole-model figure
        for r0, r1 in zip(ranks[0]["results"][name], ranks[1]["results"][name]):
            whole = train_flops(spec, r0["seq_lens"], frozen=r0["frozen"]).total
            assert rel(whole, r0["total"] + r1["total"]) < TOL


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
