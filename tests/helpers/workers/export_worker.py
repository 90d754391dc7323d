"""A short real training run that leaves a checkpoint to export, and the learner's own view
of its final weights: Megatron's logits on probe tokens (vocab shards gathered over TP) and
the live HF-named export of the parameters.

Usage (under torchrun, or `train` in-process):
    export_worker.py '[[HF_DIR, BATCH, RUN_DIR, TP, UPDATES, OVERRIDES or null], ...]'
one run after the other in one launch (each a fresh policy, parallel state re-seeded).
Each writes RUN_DIR/config.yaml (as the trainer does) and RUN_DIR/learner_final.safetensors
(rank 0: `logits` [1, S, V] FP32 and `param.<hf name>`); prints RESULT ({rank, runs: one entry per run}).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import save_file

from tests.helpers.dist_util import emit  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan
from tsync_mcore.config import load_config, to_dict
from tsync_mcore.learner import checkpoint
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.replay import read_batches
from tsync_mcore.learner.update import Learner
from tsync_mcore.model import bridge

PROBE = [[3, 17, 42, 9, 120, 77, 5, 200, 31, 64, 2, 99]]  # token ids < every tiny vocab


def train(hf_dir: str, batch: str, run_dir: str, tp: int, updates: int, par=None,
          dtype: str = "fp32", overrides: dict | None = None) -> dict:
    cfg = load_config(None, {
        "model.hf_dir": hf_dir, "model.tp": tp, "model.dtype": dtype, "run.dir": run_dir, "run.updates": updates,
        "learner.k_open": 2, "optim.lr": 1e-3, "optim.lr_schedule": "cosine",
        "optim.warmup_updates": 1, "optim.min_lr": 1e-4, "optim.weight_decay": 0.01,
        **(overrides or {})})
    policy = Policy(cfg, par=par)
    learner = Learner(cfg.learner, policy)
    for sources in read_batches(batch)[:updates]:
        learner.begin(BatchPlan.from_sources(sources))
        for s in sources:
            learner.submit(s)
        assert learner.close().summary.ok
    checkpoint.save(run_dir, policy, version=learner.version, data_pos=updates)
    with torch.no_grad():
        local = bridge.logits(policy.model, torch.tensor(PROBE)).float()
    if policy.par.tp_size > 1:  # vocab shards, in TP rank order
        shards = [torch.empty_like(local) for _ in range(policy.par.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=policy.par.tp_group)
        local = torch.cat(shards, dim=-1)
    params = policy.export_params()  # collective at TP > 1 (LoRA: merged)
    adapter = policy.export_adapter() if policy.lora is not None else {}
    if policy.par.rank == 0:
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        save_file({"logits": local.contiguous(),
                   **{f"param.{k}": v.contiguous() for k, v in params.items()},
                   **{f"adapter.{k}": v.contiguous() for k, v in adapter.items()}},
                  os.path.join(run_dir, "learner_final.safetensors"))
    if dist.is_initialized():
        dist.barrier()
    return {"rank": policy.par.rank, "version": learner.version}


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    runs = [train(hf, batch, run, int(tp), int(n), overrides=extra)
            for hf, batch, run, tp, n, extra in json.loads(sys.argv[1])]
    emit({"rank": runs[0]["rank"], "runs": runs})
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
