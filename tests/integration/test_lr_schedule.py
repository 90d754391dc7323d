"""LR schedules (Megatron's OptimizerParamScheduler): values per update, weight decay per
parameter kind, skipped updates, checkpoint and resume; and the trainer's end-of-run export.

The reference is Megatron's schedule written out here: linear warm-up from 0 over W
updates (update k runs at lr·k/W for k ≤ W), then constant at lr, or linear / cosine decay
from lr at update W to min_lr at update D, and min_lr after D.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.lr_schedule_shared import (  # noqa: F401  (shared with the unit tests)
    reference_lr,
)


def test_trainer_logs_the_schedule_resumes_it_and_exports_the_final_policy(tiny_qwen2, tmp_path):
    """3 updates, then --resume to 7 (longer than warm-up 2 + decay 4): every update's
    `lr` in metrics.jsonl and in the trace is the schedule's; RUN/hf is the final policy."""
    from tests.helpers.scripted import finish, scripted_rollout, start_learner
    from tsync_mcore.learner.export import main as export_main
    from tsync_mcore.observability import trace
    from tsync_mcore.util.net import free_port

    run = str(tmp_path / "run")
    sched = ["optim.lr_schedule=cosine", "optim.warmup_updates=2", "optim.decay_updates=4",
             "optim.min_lr=1e-5"]
    published = {}
    for updates, flags in [(3, ()), (7, ("--resume",))]:
        port = free_port()
        proc = start_learner(tiny_qwen2, run, port, updates=updates, extra=sched, flags=flags)
        got, links = scripted_rollout(port, updates, run)
        rc, out, err = finish(proc)
        for link in links:
            link.close()
        assert rc == 0, err[-4000:]
        published.update(got)
        hf = _exported(os.path.join(run, "hf"))  # replaced by the resumed run's
        assert hf.keys() == published[updates].keys()
        assert all(torch.equal(hf[k], published[updates][k]) for k in hf), updates
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    want = [reference_lr(k, "cosine", 1e-4, 1e-5, 2, 4) for k in range(7)]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12, abs=1e-18)
    records = [r for r in trace.read(os.path.join(run, "traces", "rank1.jsonl"))
               if r.kind == "update"]
    # (the trace of a resumed run may or may not keep the first run's records)
    assert len(records) >= 4 and all(r.lr == rows[r.update]["lr"] for r in records)
    cli = str(tmp_path / "cli")
    assert export_main([run, "--out", cli]) == 0  # the command writes the same directory
    assert sorted(os.listdir(cli)) == sorted(os.listdir(os.path.join(run, "hf")))
    ref = _exported(os.path.join(run, "hf"))
    assert all(torch.equal(t, ref[k]) for k, t in _exported(cli).items())


def _exported(hf_dir: str) -> dict[str, torch.Tensor]:
    return {k: v for name in sorted(os.listdir(hf_dir)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(hf_dir, name)).items()}
