"""Learner checkpoints: model, optimizer, RNG and data position, one file per rank.

    RUN/checkpoints/step_{k}/rank{R}.pt   this rank's model shard, optimizer state, RNG
    RUN/checkpoints/step_{k}/meta.json    policy version (k), data position, world layout
    RUN/checkpoints/latest                name of the newest complete checkpoint

A checkpoint is written into a temporary directory and renamed into place only after every
rank has finished, so a crash mid-save leaves the previous checkpoint intact. Resuming needs
the same world layout (ranks, TP); the next update then equals the one an uninterrupted run
would have made.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from tsync_mcore.platform import cpu
from tsync_mcore.policy import Policy


def _parts(policy: Policy) -> list:
    # get_megatron_optimizer returns a ChainedOptimizer around one optimizer per param kind.
    opt = policy.optimizer
    return list(getattr(opt, "chained_optimizers", [opt]))


def _optimizer_state(policy: Policy) -> list[dict]:
    names = {p: n for n, p in policy.model.named_parameters()}
    out = []
    with cpu.cuda_redirect():
        for opt in _parts(policy):
            state = {"optimizer": opt.state_dict(), "param_state": {}}
            if hasattr(opt, "model_param_group_index_map"):  # distributed optimizer shard
                for p in opt.model_param_group_index_map:
                    t = opt._get_main_param_and_optimizer_states(p)
                    if len(t) > 1:  # before the first step Adam holds no state yet
                        state["param_state"][names[p]] = {k: v.detach().clone()
                                                          for k, v in t.items()}
            out.append(state)
    return out


def _load_optimizer_state(policy: Policy, states: list[dict]) -> None:
    params = dict(policy.model.named_parameters())
    # no_grad: fp32 main params of the distributed optimizer are views of the model params.
    with cpu.cuda_redirect(), torch.no_grad():
        for opt, state in zip(_parts(policy), states, strict=True):
            if hasattr(opt, "model_param_group_index_map"):
                if not state["param_state"]:
                    continue  # saved before the first step: a fresh optimizer is that state
                # Allocate Adam's state in place (Megatron's own path for checkpoint loads),
                # then overwrite it shard by shard; hyper-parameters come from the config.
                opt._init_optimizer_states_with_dummy_values()
                for name, tensors in state["param_state"].items():
                    opt._set_main_param_and_optimizer_states(params[name], tensors)
            else:
                opt.load_state_dict(state["optimizer"])


def _rng_state() -> dict:
    from megatron.core import tensor_parallel
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(s: dict) -> None:
    from megatron.core import tensor_parallel
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["tracker"])


def save(run_dir: str, policy: Policy, version: int, data_pos: int) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory."""
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{version}")
    tmp = final + ".tmp"
    par = policy.par
    if par.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    torch.save({"model": {k: v.detach().clone() for k, v in policy.model.state_dict().items()
                          if isinstance(v, torch.Tensor)},
                "optimizer": _optimizer_state(policy), "rng": _rng_state()},
               os.path.join(tmp, f"rank{par.rank}.pt"))
    _barrier()
    if par.rank == 0:
        meta = {"version": version, "data_pos": data_pos, "world_size": par.world_size,
                "tp": par.tp_size}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _barrier()
    return final


def latest(run_dir: str) -> str | None:
    path = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return os.path.join(run_dir, "checkpoints", f.read().strip())


def load(ckpt_dir: str, policy: Policy) -> dict:
    """Restore this rank's state; returns meta (version, data_pos)."""
    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        meta = json.load(f)
    par = policy.par
    if (meta["world_size"], meta["tp"]) != (par.world_size, par.tp_size):
        raise ValueError(f"checkpoint {ckpt_dir} was written by {meta['world_size']} ranks with "
                         f"TP={meta['tp']}; this run has {par.world_size} ranks with TP={par.tp_size}")
    state = torch.load(os.path.join(ckpt_dir, f"rank{par.rank}.pt"), weights_only=False)
    missing, unexpected = policy.model.load_state_dict(state["model"], strict=False)
    bad = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
    if bad:
        raise ValueError(f"checkpoint {ckpt_dir} does not match the model: {bad[:5]}")
    _load_optimizer_state(policy, state["optimizer"])
    _set_rng_state(state["rng"])
    return meta


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
