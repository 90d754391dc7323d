"""Checkpoint/resume: the update after a resume equals the uninterrupted run's, bitwise."""

import hashlib  # noqa: E402
import json  # noqa: E402
import os
import pickle  # noqa: E402
import shutil

import pytest  # noqa: E402
import torch
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.helpers.checkpoint_shared import Touch, redigest_file
from tsync_mcore.learner import checkpoint  # noqa: E402
from tsync_mcore.learner.checkpoint import CheckpointError  # noqa: E402


def _policy(hf_dir: str, parallel1, distributed: bool):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-3,
                             "optim.distributed": distributed})
    return Policy(cfg, par=parallel1)


def _step(policy, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    policy.apply_and_step([torch.randn(b.shape, generator=g) * 0.01
                           for b in policy.grad_buffers()], 1.0)


def _snapshot(policy) -> dict[str, torch.Tensor]:
    """Every byte a resume may change: model, Adam state and main params, RNG."""
    out = {f"model.{k}": v.clone() for k, v in policy.model.state_dict().items()
           if isinstance(v, torch.Tensor)}
    for i, opt in enumerate(checkpoint._parts(policy)):
        for j, g in enumerate(opt.optimizer.param_groups):
            for n, p in enumerate(g["params"]):
                out[f"main.{i}.{j}.{n}"] = p.detach().clone()
                for k, v in opt.optimizer.state.get(p, {}).items():
                    out[f"state.{i}.{j}.{n}.{k}"] = v.clone()
    out["rng"] = torch.get_rng_state()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module", params=[True, False], ids=["distributed", "plain"])
def saved(request, tiny_qwen2, parallel1, tmp_path_factory):
    """A policy stepped twice after saving at step 1: (policy, run dir, snapshot at step 1)."""
    policy = _policy(tiny_qwen2, parallel1, request.param)
    assert not policy.sharded  # one data-parallel rank: nothing to shard, either way
    run = str(tmp_path_factory.mktemp("run"))
    _step(policy, 0)
    checkpoint.save(run, policy, version=1, data_pos=1)
    at_save = _snapshot(policy)
    _step(policy, 1)
    return policy, run, at_save


def _rank0(run: str) -> str:
    return os.path.join(run, "checkpoints", "step_1", "rank0.safetensors")


def _rewrite(path: str, edit) -> None:
    """Rewrite a rank file through `edit(tensors, header)`, its digest updated to match (an
    attacker who can write the file can write the digest too)."""
    with safe_open(path, "pt") as f:
        tensors, header = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    edit(tensors, header)
    save_file(tensors, path, metadata=header)
    redigest_file(path)


def _drop_optimizer(tensors, header):
    for k in [k for k in tensors if k.startswith("optimizer.")][::2]:
        del tensors[k]


def _wrong_shape(tensors, header):
    k = next(k for k in tensors if k.endswith(".exp_avg"))
    tensors[k] = tensors[k][:-1].clone()


def _wrong_dtype(tensors, header):
    k = next(k for k in tensors if k.startswith("model."))
    tensors[k] = tensors[k].double()


def _extra(tensors, header):
    tensors["optimizer.0.decoder.layers.9.fake.weight.exp_avg"] = torch.zeros(3)


def _nan(tensors, header):
    k = next(k for k in tensors if k.endswith(".exp_avg_sq"))
    tensors[k][0] = float("nan")


def _claims_unstepped(tensors, header):
    state = json.loads(header["state"])
    state["stepped"] = [False] * len(state["stepped"])
    header["state"] = json.dumps(state)


def _bad_python_rng(tensors, header):
    state = json.loads(header["state"])
    state["python_rng"][1][0] = -1
    header["state"] = json.dumps(state)


def _edit_meta(**changes):
    def edit(run):
        path = os.path.join(run, "checkpoints", "step_1", "meta.json")
        meta = json.load(open(path))
        meta.update(changes)
        json.dump(meta, open(path, "w"))
        return "meta.json"
    return edit


def _edit_rank(fn):
    def edit(run):
        _rewrite(_rank0(run), fn)
        return "rank0.safetensors"
    return edit


def _truncate(redigest: bool):
    def edit(run):
        path = _rank0(run)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size - 100)
        if redigest:
            redigest_file(path)
        return "rank0.safetensors"
    return edit


def _latest(text: str):
    def edit(run):
        open(os.path.join(run, "checkpoints", "latest"), "w").write(text)
        return "latest"
    return edit


def _symlinked_step(run):
    ckpt = os.path.join(run, "checkpoints")
    outside = os.path.join(run, "elsewhere")
    shutil.copytree(os.path.join(ckpt, "step_1"), outside)
    os.symlink(outside, os.path.join(ckpt, "step_7"))
    open(os.path.join(ckpt, "latest"), "w").write("step_7")
    return "step_7"


TAMPERING = {
    "meta_version": _edit_meta(version=2),
    "meta_data_pos_negative": _edit_meta(data_pos=-1),
    "meta_data_pos_string": _edit_meta(data_pos="1"),
    "meta_data_pos_other": _edit_meta(data_pos=5),
    "meta_world_bool": _edit_meta(world_size=True),
    "meta_extra_key": _edit_meta(run="x"),
    "missing_optimizer_tensors": _edit_rank(_drop_optimizer),
    "wrong_shape": _edit_rank(_wrong_shape),
    "wrong_dtype": _edit_rank(_wrong_dtype),
    "extra_tensor": _edit_rank(_extra),
    "non_finite": _edit_rank(_nan),
    "claims_unstepped": _edit_rank(_claims_unstepped),
    "bad_python_rng": _edit_rank(_bad_python_rng),
    "truncated": _truncate(redigest=True),
    "truncated_digest_mismatch": _truncate(redigest=False),
    "latest_traversal": _latest("../../etc"),
    "latest_absolute": _latest("/tmp/step_1"),
    "latest_missing_dir": _latest("step_9"),
    "latest_symlink_escape": _symlinked_step,
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_tampered_checkpoint_is_refused_and_state_untouched(saved, case, tmp_path):
    policy, run, _ = saved
    mine = str(tmp_path / "run")
    shutil.copytree(run, mine, symlinks=True)
    named = TAMPERING[case](mine)
    before = _snapshot(policy)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(checkpoint.latest(mine), policy)
    msg = str(e.value)
    assert "\n" not in msg and named in msg, msg
    assert _same(before, _snapshot(policy))


def test_resume_restores_the_saved_state_exactly(saved, tmp_path):
    policy, run, at_save = saved
    assert not _same(at_save, _snapshot(policy))  # the step after saving changed the state
    meta = checkpoint.load(checkpoint.latest(run), policy)
    assert (meta["version"], meta["data_pos"]) == (1, 1)
    assert _same(at_save, _snapshot(policy))


def test_checkpoint_files_are_private(saved):
    _, run, _ = saved
    ckpt = os.path.join(run, "checkpoints")
    assert os.stat(ckpt).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(ckpt, "step_1")).st_mode & 0o777 == 0o700
    for name in ("latest", "step_1/meta.json", "step_1/rank0.safetensors", "step_1/rank0.sha256"):
        assert os.stat(os.path.join(ckpt, name)).st_mode & 0o777 == 0o600, name


def test_payload_is_live(tmp_path):
    marker = str(tmp_path / "ran")
    pickle.loads(pickle.dumps(Touch(marker)))  # what torch.load(weights_only=False) did
    assert os.path.exists(marker)
