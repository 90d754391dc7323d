"""LR schedules (Megatron's OptimizerParamScheduler): values per update, weight decay per
parameter kind, skipped updates, checkpoint and resume; and the trainer's end-of-run export.

The reference is Megatron's schedule written out here: linear warm-up from 0 over W
updates (update k runs at lr·k/W for k ≤ W), then constant at lr, or linear / cosine decay
from lr at update W to min_lr at update D, and min_lr after D.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.helpers.lr_schedule_shared import reference_lr
from tsync_mcore.config import ConfigError, load_config
from tsync_mcore.learner import checkpoint
from tsync_mcore.learner.checkpoint import CheckpointError


def _policy(hf_dir, par, **optim):
    from tsync_mcore.learner.policy import Policy
    cfg = load_config(None, {"model.hf_dir": hf_dir, "run.updates": 20, "optim.lr": 1e-3,
                             **{f"optim.{k}": v for k, v in optim.items()}})
    return Policy(cfg, par=par)


def _grads(policy, seed: int, scale: float = 0.01) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b.shape, generator=g) * scale for b in policy.grad_buffers()]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_per_update_is_megatrons_schedule(tiny_qwen2, parallel1, style):
    W, D, lr, min_lr = 3, 8, 1e-3, 1e-4
    policy = _policy(tiny_qwen2, parallel1, lr_schedule=style, warmup_updates=W,
                     decay_updates=D, min_lr=min_lr)
    before = policy.export_params()
    got = []
    for k in range(12):  # longer than warm-up + decay
        step = policy.apply_and_step(_grads(policy, k), 1.0)
        assert step.ok
        got.append(step.lr)
        if k == 0:  # update 0 runs at lr 0: θ does not move (so the LR reaches the optimizer)
            after = policy.export_params()
            assert all(torch.equal(before[n], after[n]) for n in before)
    want = [reference_lr(k, style, lr, min_lr, W, D) for k in range(12)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert got[1] > 0 and (style == "constant" or got[-1] == min_lr)


def test_weight_decay_skips_biases_and_norms(tiny_qwen2, parallel1):
    """A zero gradient: AdamW's update is then exactly the decay, p ← p·(1 − lr·wd), applied
    to the matrices and to nothing one-dimensional (biases, norms), as in Megatron-LM."""
    lr, wd = 1e-2, 0.1
    policy = _policy(tiny_qwen2, parallel1, lr=lr, weight_decay=wd)
    before = policy.export_params()
    assert policy.apply_and_step([torch.zeros(b.shape) for b in policy.grad_buffers()], 1.0).ok
    after = policy.export_params()
    for name, p in before.items():
        if p.ndim == 1:
            assert torch.equal(after[name], p), name
        else:
            torch.testing.assert_close(after[name], p * (1 - lr * wd), rtol=1e-6, atol=0)


def test_skipped_update_does_not_advance_the_schedule(tiny_qwen2, parallel1):
    policy = _policy(tiny_qwen2, parallel1, lr_schedule="linear", warmup_updates=2)
    assert policy.apply_and_step(_grads(policy, 0), 1.0).ok
    bad = _grads(policy, 1)
    bad[0][3] = float("nan")
    skipped = policy.apply_and_step(bad, 1.0)
    assert not skipped.ok and policy.scheduler.num_steps == 1
    nxt = policy.apply_and_step(_grads(policy, 2), 1.0)
    assert nxt.ok and nxt.lr == skipped.lr == pytest.approx(0.5e-3)


@pytest.fixture
def saved(tiny_qwen2, parallel1, tmp_path):
    """Cosine schedule, checkpoint after 3 updates, then 3 more: (policy, run, their LRs)."""
    policy = _policy(tiny_qwen2, parallel1, lr_schedule="cosine", warmup_updates=2,
                     decay_updates=6, min_lr=1e-5)
    for k in range(3):
        policy.apply_and_step(_grads(policy, k), 1.0)
    run = str(tmp_path / "run")
    checkpoint.save(run, policy, version=3, data_pos=3)
    after = [policy.apply_and_step(_grads(policy, 10 + k), 1.0).lr for k in range(3)]
    return policy, run, after


def test_checkpoint_restores_the_schedule_position(saved):
    policy, run, after = saved
    with safe_open(os.path.join(run, "checkpoints", "step_3", "rank0.safetensors"), "pt") as f:
        state = json.loads(f.metadata()["state"])["lr_scheduler"]
    assert state["num_steps"] == 3 and state["lr_decay_style"] == "cosine"
    checkpoint.load(checkpoint.latest(run), policy)
    assert policy.scheduler.num_steps == 3
    again = [policy.apply_and_step(_grads(policy, 10 + k), 1.0).lr for k in range(3)]
    assert again == after
    assert after == pytest.approx([reference_lr(k, "cosine", 1e-3, 1e-5, 2, 6)
                                   for k in (3, 4, 5)], rel=1e-12)


def _edit_scheduler(**change):
    def edit(state):
        sched = state["lr_scheduler"]
        for k, v in change.items():
            if v is KeyError:
                del sched[k]
            else:
                sched[k] = v
    return edit


SCHEDULER_TAMPERING = {
    "missing_key": _edit_scheduler(num_steps=KeyError),
    "extra_key": _edit_scheduler(warmup_iter=3),
    "string_steps": _edit_scheduler(num_steps="3"),
    "negative_steps": _edit_scheduler(num_steps=-1),
    "bool_steps": _edit_scheduler(num_steps=True),
    "nan_lr": _edit_scheduler(max_lr=float("nan")),
    "unknown_style": _edit_scheduler(lr_decay_style="WSD"),
    "not_a_dict": lambda state: state.update(lr_scheduler=[3]),
}


@pytest.mark.parametrize("case", list(SCHEDULER_TAMPERING))
def test_tampered_scheduler_state_is_refused(saved, tmp_path, case):
    policy, run, _ = saved
    mine = str(tmp_path / "copy")
    shutil.copytree(run, mine)
    path = os.path.join(mine, "checkpoints", "step_3", "rank0.safetensors")
    with safe_open(path, "pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    state = json.loads(header["state"])
    SCHEDULER_TAMPERING[case](state)
    header["state"] = json.dumps(state)
    save_file(tensors, path, metadata=header)
    with open(path.removesuffix(".safetensors") + ".sha256", "w") as f:
        f.write(hashlib.sha256(open(path, "rb").read()).hexdigest())
    steps, lr = policy.scheduler.num_steps, policy.lr
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(checkpoint.latest(mine), policy)
    assert "rank0.safetensors" in str(e.value) and "lr_scheduler" in str(e.value)
    assert (policy.scheduler.num_steps, policy.lr) == (steps, lr)


@pytest.mark.parametrize("sets,key", [
    ({"optim.warmup_updates": 5, "run.updates": 5}, "optim.warmup_updates"),
    ({"optim.warmup_updates": 4, "optim.decay_updates": 4}, "optim.warmup_updates"),
    ({"optim.lr_schedule": "cosine", "optim.min_lr": 1.0}, "optim.min_lr"),
    ({"optim.min_lr": -1e-6}, "optim.min_lr"),
    ({"optim.decay_updates": -1}, "optim.decay_updates"),
    ({"optim.lr_schedule": "step"}, "optim.lr_schedule"),
])
def test_bad_schedule_config_names_the_key(sets, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, sets)
    load_config(None, {"optim.lr_schedule": "constant", "optim.min_lr": 1.0})  # unused there
