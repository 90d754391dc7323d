"""LoRA runs: checkpoints (adapters only, resume), export (merged HF weights + a PEFT adapter
directory), the adapter's TP layout, and the config/adapter-directory checks.

The references: the learner's own live merged export and adapter, and `peft` itself
(`PeftModel.from_pretrained(...).merge_and_unload()` of the exported adapter on the base)."""

from __future__ import annotations

import json
import os

from tests.helpers.batchgen import write_batches
from tests.helpers.dist_util import run_dist
from tests.helpers.lora_export_shared import (  # noqa: F401  (shared with the unit tests)
    LORA,
    check_export,
    peft_merged,
    rel,
)
from tests.helpers.paths import ROOT

WORKER = os.path.join(ROOT, "tests/helpers/workers/export_worker.py")


def test_lora_checkpoint_export_tp2(tiny_qwen2, tmp_path):
    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, 256, n_updates=2, seed=6)
    run = str(tmp_path / "run")
    out = run_dist([WORKER, tiny_qwen2, batch, run, "2", "2", json.dumps(LORA)], nproc=2)
    assert [r["version"] for r in out] == [2, 2]
    check_export(run, str(tmp_path / "hf"), tiny_qwen2)
