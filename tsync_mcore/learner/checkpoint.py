"""Learner checkpoints: model, optimizer, RNG and data position, one file per rank.

    RUN/checkpoints/step_{k}/rank{R}.safetensors  this rank's tensors: model shard, Adam
                                                  state per parameter, RNG; JSON metadata
                                                  (also the LR scheduler's position)
    RUN/checkpoints/step_{k}/rank{R}.sha256       digest of that file
    RUN/checkpoints/step_{k}/meta.json            policy version (k), data position, layout
    RUN/checkpoints/latest                        name of the newest complete checkpoint

Nothing is pickled: tensors go to safetensors under structured names, everything else is
JSON, so reading a checkpoint cannot run code. A checkpoint is written into a temporary
directory and renamed into place only after every rank has finished, so a crash mid-save
leaves the previous checkpoint intact. `load` checks everything (files, types, that the
tensors cover exactly this rank's parameters with their shapes and dtypes) on every rank
before it changes anything, so a refused resume leaves model and optimizer untouched.
Resuming needs the same world layout (ranks, TP, EP); the next update then equals the one an
uninterrupted run would have made. Optimizer hyper-parameters come from the config.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tsync_mcore.model import optimizer
from tsync_mcore.platform import cpu
from tsync_mcore.learner.policy import Policy
from tsync_mcore.util.safe_files import (BadFile, private_dir, read_json_object,
                                         read_safetensors, regular_file, safetensors_header)

FORMAT = "tsync-checkpoint/1"
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")  # torch Adam's per-parameter state
_STEP_DIR = re.compile(r"step_(0|[1-9][0-9]{0,17})")
_META_KEYS = {"format": str, "version": int, "data_pos": int, "world_size": int, "tp": int}
# Megatron's OptimizerParamScheduler.state_dict(); the config gives the schedule on resume,
# the checkpoint its position (num_steps: applied updates)
_SCHEDULER_KEYS = {"max_lr": float, "min_lr": float, "start_wd": float, "end_wd": float,
                   "lr_warmup_steps": int, "num_steps": int, "lr_decay_steps": int,
                   "wd_incr_steps": int, "lr_decay_style": str, "wd_incr_style": str}
_SCHEDULER_STYLES = {"lr_decay_style": ("constant", "linear", "cosine"),
                     "wd_incr_style": ("constant",)}


class CheckpointError(BadFile):
    """A checkpoint that cannot be resumed from; the message names the file and why."""


# --------------------------------------------------------------------------- what is saved


def _parts(policy: Policy) -> list:
    # get_megatron_optimizer returns a ChainedOptimizer around one optimizer per param kind.
    opt = policy.optimizer
    return list(getattr(opt, "chained_optimizers", [opt]))


def _main_params(opt, names: dict) -> dict[str, torch.Tensor]:
    """Model parameter name -> the tensor this optimizer part updates for it: the fp32 main
    copy (a shard of it with the distributed optimizer), or the parameter itself."""
    groups = opt.optimizer.param_groups
    if hasattr(opt, "model_param_group_index_map"):  # distributed optimizer
        return {names[p]: groups[g]["params"][i]
                for p, (g, i) in opt.model_param_group_index_map.items()}
    inner = {id(q) for g in groups for q in g["params"]}
    out = {}
    for p, name in names.items():
        for cand in (getattr(p, "main_param", None), p):  # Float16Optimizer sets main_param
            if cand is not None and id(cand) in inner:
                out[name] = cand
                break
    return out


def _model_tensors(policy: Policy) -> dict[str, torch.Tensor]:
    # _extra_state entries are TE's FP8 metadata (unused here), not model state. With LoRA
    # the frozen base is model.hf_dir's, unchanged: a checkpoint holds the adapters only.
    return {k: v for k, v in policy.model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
            and (policy.lora is None or ".lora." in k)}


def _tracker():
    from megatron.core import tensor_parallel
    return tensor_parallel.get_cuda_rng_tracker()


def _collect(policy: Policy) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's tensors by structured name, and the JSON-able rest."""
    names = {p: n for n, p in policy.model.named_parameters()}
    tensors = {f"model.{k}": v for k, v in _model_tensors(policy).items()}
    stepped = []
    for i, opt in enumerate(_parts(policy)):
        mains = _main_params(opt, names)
        states = {n: opt.optimizer.state.get(m, {}) for n, m in mains.items()}
        stepped.append(any(states.values()))  # before the first step Adam holds no state
        if stepped[-1]:
            for n, m in mains.items():
                tensors[f"optimizer.{i}.{n}.param"] = m
                for k in ADAM_STATE:
                    tensors[f"optimizer.{i}.{n}.{k}"] = states[n][k]
    tensors["rng.torch"] = torch.get_rng_state()
    for k, v in _tracker().get_states().items():
        tensors[f"rng.tracker.{k}"] = v
    np_state = np.random.get_state()
    rest = {"stepped": stepped, "python_rng": _py_rng_to_json(random.getstate()),
            "numpy_rng": [np_state[0], np_state[1].tolist(), *map(_plain, np_state[2:])],
            "lr_scheduler": policy.scheduler.state_dict()}
    # A private CPU copy per tensor: safetensors refuses shared storage (views, tied weights).
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}, rest


def _plain(x):
    return x.item() if isinstance(x, np.generic) else x


def _py_rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


# --------------------------------------------------------------------------- save


def save(run_dir: str, policy: Policy, version: int, data_pos: int) -> str:
    """Collective: every rank writes its file; returns the checkpoint directory."""
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{version}")
    tmp = final + ".tmp"
    par = policy.par
    if par.rank == 0:
        _private_dir(root)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp, 0o700)
        os.chmod(tmp, 0o700)  # mkdir's mode is masked by the umask
    _barrier()
    with cpu.cuda_redirect():
        tensors, rest = _collect(policy)
    header = {"format": FORMAT, "rank": str(par.rank), "world_size": str(par.world_size),
              "tp": str(par.tp_size), "version": str(version), "data_pos": str(data_pos),
              "state": json.dumps(rest), **_ep_header(policy)}
    path = os.path.join(tmp, f"rank{par.rank}.safetensors")
    save_file(tensors, path, metadata=header)
    os.chmod(path, 0o600)
    _write_private(os.path.join(tmp, f"rank{par.rank}.sha256"), _sha256(path) + "\n")
    _barrier()
    if par.rank == 0:
        meta = {"format": FORMAT, "version": version, "data_pos": data_pos,
                "world_size": par.world_size, "tp": par.tp_size}
        if policy.lora is not None:  # what export needs to rebuild the PEFT adapter
            meta["lora"] = policy.lora.to_json()
        if policy.ep_size > 1:  # each rank holds its own experts (export gathers them)
            meta["ep"] = policy.ep_size
        _write_private(os.path.join(tmp, "meta.json"), json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_private(os.path.join(root, "latest.tmp"), os.path.basename(final))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _barrier()
    return final


def _ep_header(policy: Policy) -> dict[str, str]:
    """Expert parallelism in a rank file's header: the size and this rank's place, so a
    resume and an export know which experts the file holds (absent at ep 1)."""
    if policy.ep_size == 1:
        return {}
    from megatron.core import parallel_state as ps
    return {"ep": str(policy.ep_size), "ep_rank": str(ps.get_expert_model_parallel_rank())}


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- find


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint directory, or None when there is none yet. `latest`
    must name a step_N directory directly inside checkpoints/ (no path, no symlink)."""
    root = os.path.join(run_dir, "checkpoints")
    path = os.path.join(root, "latest")
    if not os.path.lexists(path):
        return None
    regular = _checked(regular_file, path)
    if regular.st_size > 64:
        raise CheckpointError(f"checkpoint pointer {path}: larger than 64 bytes")
    try:
        with open(path, encoding="ascii") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint pointer {path}: unreadable ({e})") from None
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"checkpoint pointer {path}: {name[:40]!r} is not a step_N name")
    ckpt = os.path.join(root, name)
    _check_step_dir(ckpt, root, via=path)
    return ckpt


def _check_step_dir(ckpt: str, root: str, via: str = "") -> None:
    where = f"checkpoint pointer {via}: {os.path.basename(ckpt)}" if via else f"checkpoint {ckpt}"
    if os.path.islink(ckpt):
        raise CheckpointError(f"{where} is a symlink")
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{where} is missing or not a directory")
    if os.path.dirname(os.path.realpath(ckpt)) != os.path.realpath(root):
        raise CheckpointError(f"{where} resolves outside {root}")


def _checked(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except CheckpointError:
        raise
    except BadFile as e:
        raise CheckpointError(f"checkpoint {e}") from None


# --------------------------------------------------------------------------- load


@dataclass
class _Plan:
    """What a validated checkpoint restores on this rank."""
    meta: dict
    tensors: dict[str, torch.Tensor]
    rest: dict


def load(ckpt_dir: str, policy: Policy) -> dict:
    """Collective: check this rank's part, agree with every rank that all parts are good,
    then restore. Returns meta (version, data_pos). Raises CheckpointError, leaving model,
    optimizer and RNG untouched, if any rank's part is refused."""
    error = None
    try:
        plan = _validate(ckpt_dir, policy)
    except CheckpointError as e:
        error = e
    except Exception as e:  # still a refusal, and still this rank's vote (no peer hangs)
        error = CheckpointError(f"checkpoint {ckpt_dir}: unreadable ({type(e).__name__}: {e})")
    bad = _count_failures(error is not None, policy)
    if error is not None:
        raise error
    if bad:
        raise CheckpointError(f"checkpoint {ckpt_dir}: refused by {bad} other rank(s) (their "
                              f"error names the file)")
    _apply(plan, policy)
    return plan.meta


def step_meta(ckpt_dir: str) -> dict:
    """The checked meta.json of a step_N checkpoint directory (name, directory and every
    key checked); the rank files are checked by whoever reads them."""
    ckpt_dir = os.path.normpath(ckpt_dir)
    name = os.path.basename(ckpt_dir)
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"checkpoint {ckpt_dir}: directory name is not step_N")
    _check_step_dir(ckpt_dir, os.path.dirname(ckpt_dir))
    return _read_meta(os.path.join(ckpt_dir, "meta.json"), int(name[len("step_"):]))


def rank_file(ckpt_dir: str, rank: int, meta: dict) -> str:
    """Path of rank `rank`'s file, after checking it is a regular file that matches its
    digest and that its header agrees with `meta` (tensors are checked by the reader)."""
    path = os.path.join(os.path.normpath(ckpt_dir), f"rank{rank}.safetensors")
    _checked(regular_file, path)
    _check_digest(path)
    _, header = _checked(safetensors_header, path)
    _check_header(header, rank, meta, f"checkpoint {path}")
    return path


def _check_header(header: dict, rank: int, meta: dict, where: str) -> None:
    want = {"format": FORMAT, "rank": str(rank), "world_size": str(meta["world_size"]),
            "tp": str(meta["tp"]), "version": str(meta["version"]),
            "data_pos": str(meta["data_pos"])}
    if meta.get("ep", 1) > 1:
        want["ep"] = str(meta["ep"])
    for k, v in want.items():
        if header.get(k) != v:
            raise CheckpointError(f"{where}: header {k}={header.get(k)!r}, meta.json/this "
                                  f"run says {v!r}")


def _validate(ckpt_dir: str, policy: Policy) -> _Plan:
    ckpt_dir = os.path.normpath(ckpt_dir)
    par = policy.par
    meta = step_meta(ckpt_dir)
    mpath = os.path.join(ckpt_dir, "meta.json")
    if (meta["world_size"], meta["tp"]) != (par.world_size, par.tp_size):
        raise CheckpointError(f"checkpoint {mpath}: written by {meta['world_size']} ranks with "
                              f"TP={meta['tp']}; this run has {par.world_size} ranks with "
                              f"TP={par.tp_size}")
    if meta.get("ep", 1) != policy.ep_size:
        raise CheckpointError(f"checkpoint {mpath}: written with model.ep {meta.get('ep', 1)}; "
                              f"this run has model.ep {policy.ep_size}")
    if meta.get("lora") != policy.lora:
        raise CheckpointError(f"checkpoint {mpath}: LoRA {_lora_text(meta.get('lora'))}; this "
                              f"run has {_lora_text(policy.lora)}")
    path = os.path.join(ckpt_dir, f"rank{par.rank}.safetensors")
    where = f"checkpoint {path}"
    _checked(regular_file, path)
    _check_digest(path)
    tensors, header = _checked(read_safetensors, path)
    _check_header(header, par.rank, meta, where)
    try:
        rest = json.loads(header.get("state", ""))
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where}: header 'state' is not JSON ({e})") from None
    n_parts = len(_parts(policy))
    rest = _check_rest(rest, n_parts, where)
    _check_tensors(tensors, _expected(policy, rest["stepped"]), where)
    return _Plan(meta=meta, tensors=tensors, rest=rest)


def _lora_text(lora) -> str:
    return "none (every weight trained)" if lora is None else \
        f"r={lora.rank}, alpha={lora.alpha}, targets {list(lora.targets)}"


def _read_meta(path: str, step: int) -> dict:
    meta = _checked(read_json_object, path, follow_symlinks=False)
    lora_meta = meta.pop("lora", None)  # optional: present in a LoRA run's checkpoints
    ep = meta.pop("ep", None)  # optional: present when model.ep > 1
    if set(meta) != set(_META_KEYS):
        raise CheckpointError(f"checkpoint {path}: keys {sorted(meta)}, expected "
                              f"{sorted(_META_KEYS)}")
    for k, typ in _META_KEYS.items():
        if type(meta[k]) is not typ:  # bool is not an int here
            raise CheckpointError(f"checkpoint {path}: {k} must be {typ.__name__}, got "
                                  f"{meta[k]!r}")
    if meta["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta['format']!r}, expected {FORMAT!r}")
    if meta["version"] != step:
        raise CheckpointError(f"checkpoint {path}: version {meta['version']} but the directory "
                              f"is step_{step}")
    if not 0 <= meta["data_pos"] < 1 << 62:
        raise CheckpointError(f"checkpoint {path}: data_pos {meta['data_pos']} out of range")
    if not (1 <= meta["world_size"] <= 1 << 20 and 1 <= meta["tp"] <= meta["world_size"]):
        raise CheckpointError(f"checkpoint {path}: world_size {meta['world_size']} / tp "
                              f"{meta['tp']} out of range")
    if ep is not None:
        if type(ep) is not int or not 2 <= ep <= meta["world_size"] \
                or meta["world_size"] % (ep * meta["tp"]):
            raise CheckpointError(f"checkpoint {path}: ep {ep!r} must be an integer >= 2 with "
                                  f"tp × ep dividing world_size {meta['world_size']}")
        meta["ep"] = ep
    if lora_meta is not None:
        from tsync_mcore.model.lora import LoraSpec
        meta["lora"] = _checked(LoraSpec.from_json, lora_meta, path)
    return meta


def _check_digest(path: str) -> None:
    dpath = path.removesuffix(".safetensors") + ".sha256"
    st = _checked(regular_file, dpath)
    if st.st_size > 128:
        raise CheckpointError(f"checkpoint {dpath}: larger than 128 bytes")
    with open(dpath, "rb") as f:
        want = f.read().strip().decode("ascii", "replace")
    if _sha256(path) != want:
        raise CheckpointError(f"checkpoint {path}: contents do not match {dpath} (corrupt or "
                              f"edited)")


def _check_rest(rest, n_parts: int, where: str) -> dict:
    if not isinstance(rest, dict) or set(rest) != {"stepped", "python_rng", "numpy_rng",
                                                   "lr_scheduler"}:
        raise CheckpointError(f"{where}: header 'state' must hold stepped, python_rng, "
                              f"numpy_rng, lr_scheduler")
    stepped = rest["stepped"]
    if not (isinstance(stepped, list) and len(stepped) == n_parts
            and all(type(s) is bool for s in stepped)):
        raise CheckpointError(f"{where}: 'stepped' must be {n_parts} booleans, got {stepped!r}")
    return {"stepped": stepped, "python_rng": _py_rng_state(rest["python_rng"], where),
            "numpy_rng": _np_rng_state(rest["numpy_rng"], where),
            "lr_scheduler": _scheduler_state(rest["lr_scheduler"], where)}


def _scheduler_state(s, where: str) -> dict:
    """Megatron's scheduler state: exactly its keys, each of its type, finite, in range."""
    if not isinstance(s, dict) or set(s) != set(_SCHEDULER_KEYS):
        got = sorted(s) if isinstance(s, dict) else type(s).__name__
        raise CheckpointError(f"{where}: lr_scheduler must hold {sorted(_SCHEDULER_KEYS)}, got "
                              f"{got}")
    for k, typ in _SCHEDULER_KEYS.items():
        v = s[k]
        ok = type(v) is typ and (
            (typ is float and math.isfinite(v) and 0 <= v < 1e6)
            or (typ is int and 0 <= v < 1 << 40)
            or (typ is str and v in _SCHEDULER_STYLES[k]))
        if not ok:
            raise CheckpointError(f"{where}: lr_scheduler {k}={v!r:.40} is not a valid value")
    return dict(s)


def _u32s(xs, n: int) -> bool:
    return isinstance(xs, list) and len(xs) == n and all(
        type(x) is int and 0 <= x < 1 << 32 for x in xs)


def _py_rng_state(s, where: str) -> tuple:
    # random.getstate(): (3, 624 MT words + the position in 1..624, gauss_next or None)
    ok = (isinstance(s, list) and len(s) == 3 and s[0] == 3 and type(s[0]) is int
          and _u32s(s[1], 625) and 1 <= s[1][624] <= 624
          and (s[2] is None or (type(s[2]) is float and math.isfinite(s[2]))))
    if not ok:
        raise CheckpointError(f"{where}: python_rng is not a Python random state")
    return 3, tuple(s[1]), s[2]


def _np_rng_state(s, where: str) -> tuple:
    # np.random.get_state(): ('MT19937', 624 uint32 words, pos, has_gauss, cached_gaussian)
    ok = (isinstance(s, list) and len(s) == 5 and s[0] == "MT19937" and _u32s(s[1], 624)
          and type(s[2]) is int and 0 <= s[2] <= 624 and s[3] in (0, 1) and type(s[3]) is int
          and type(s[4]) is float and math.isfinite(s[4]))
    if not ok:
        raise CheckpointError(f"{where}: numpy_rng is not a NumPy MT19937 state")
    return s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]


def _expected(policy: Policy, stepped: list[bool]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor this rank's checkpoint must hold: name -> (shape, dtype)."""
    want = {f"model.{k}": (v.shape, v.dtype) for k, v in _model_tensors(policy).items()}
    names = {p: n for n, p in policy.model.named_parameters()}
    for i, opt in enumerate(_parts(policy)):
        if not stepped[i]:
            continue
        for n, m in _main_params(opt, names).items():
            for k in ("param", "exp_avg", "exp_avg_sq"):
                want[f"optimizer.{i}.{n}.{k}"] = (m.shape, m.dtype)
            want[f"optimizer.{i}.{n}.step"] = (torch.Size([]), torch.float32)
    cur = torch.get_rng_state()
    want["rng.torch"] = (cur.shape, cur.dtype)
    for k, v in _tracker().get_states().items():
        want[f"rng.tracker.{k}"] = (v.shape, v.dtype)
    return want


def _check_tensors(tensors: dict[str, torch.Tensor], want: dict, where: str) -> None:
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} (not part of this "
                              f"rank's state)" + (f" (and {len(extra) - 1} more)"
                                                  if len(extra) > 1 else ""))
    for k, (shape, dtype) in want.items():
        t = tensors[k]
        if t.shape != shape or t.dtype != dtype:
            raise CheckpointError(f"{where}: tensor {k!r} is {tuple(t.shape)} {t.dtype}, this "
                                  f"rank's is {tuple(shape)} {dtype}")
        if t.is_floating_point() and not k.startswith("rng.") and not torch.isfinite(t).all():
            raise CheckpointError(f"{where}: tensor {k!r} holds non-finite values")
        if k.endswith(".exp_avg_sq") and (t < 0).any():
            raise CheckpointError(f"{where}: tensor {k!r} holds negative values")
        if k.endswith(".step") and k.startswith("optimizer.") and not (
                0 <= t.item() < 1 << 40 and t.item() == int(t.item())):
            raise CheckpointError(f"{where}: tensor {k!r} is not a step count ({t.item()})")


def _count_failures(failed: bool, policy: Policy) -> int:
    """How many other ranks refused their part (every rank calls this once)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    t = torch.tensor([int(failed)], dtype=torch.int64, device=policy.device)
    dist.all_reduce(t)
    return int(t.item()) - int(failed)


def _apply(plan: _Plan, policy: Policy) -> None:
    """Restore a validated checkpoint (only copies of checked tensors from here on)."""
    t = plan.tensors
    model = {k[len("model."):]: v for k, v in t.items() if k.startswith("model.")}
    names = {p: n for n, p in policy.model.named_parameters()}
    # no_grad: fp32 main params of the distributed optimizer are views of the model params.
    with cpu.cuda_redirect(), torch.no_grad():
        policy.model.load_state_dict(model, strict=False)
        for i, opt in enumerate(_parts(policy)):
            if not plan.rest["stepped"][i]:
                continue  # saved before the first step: a fresh optimizer is that state
            inner = opt.optimizer
            for n, m in _main_params(opt, names).items():
                m.copy_(t[f"optimizer.{i}.{n}.param"])
                state = inner.state[m]
                if not state:  # allocate what Adam's first step would
                    group = next(g for g in inner.param_groups if any(q is m for q in g["params"]))
                    on_param = group.get("capturable") or group.get("fused")
                    state["step"] = torch.zeros((), dtype=torch.float32,
                                                device=m.device if on_param else "cpu")
                    state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                for k in ADAM_STATE:
                    state[k].copy_(t[f"optimizer.{i}.{n}.{k}"])
    # The schedule is the config's; the checkpoint gives its position.
    optimizer.set_scheduler_position(policy.scheduler, plan.rest["lr_scheduler"]["num_steps"])
    torch.set_rng_state(t["rng.torch"])
    random.setstate(plan.rest["python_rng"])
    np.random.set_state(plan.rest["numpy_rng"])
    _tracker().set_states({k[len("rng.tracker."):]: v for k, v in t.items()
                           if k.startswith("rng.tracker.")})


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------- across nodes


def check_shared_run_dir(run_dir: str, par, device, where: str) -> None:
    """Multi-node learners: every rank must see run.dir as rank 0 writes it, since the ranks
    of other nodes write their checkpoint files into rank 0's step directory and a resume
    reads them back there. Rank 0 writes a random token; a rank that cannot read it back
    stops the run now, naming itself (`where`), instead of failing at the first checkpoint
    or resuming from another state. Collective."""
    token = os.urandom(16).hex().encode() if par.rank == 0 else b"0" * 32
    path = os.path.join(run_dir, ".learner_nodes")
    if par.rank == 0:
        private_dir(run_dir)
        _write_private(path, token.decode())
    t = torch.frombuffer(bytearray(token), dtype=torch.uint8).to(device)
    dist.broadcast(t, src=0)
    want = bytes(t.cpu().tolist()).decode()
    try:
        with open(path, encoding="ascii") as f:
            seen = f.read(33).strip() == want
    except (OSError, UnicodeDecodeError):
        seen = False
    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(par.world_size)]
    dist.all_gather(flags, torch.tensor([int(not seen)], dtype=torch.int64, device=device))
    blind = [r for r, f in enumerate(flags) if f.item()]
    if not blind:
        return
    need = ("multi-node learners need run.dir on a filesystem every learner node shares "
            "(checkpoints are written and resumed there; docs/guide/multihost.md)")
    if not seen:
        raise CheckpointError(f"{where} does not see run.dir {os.path.abspath(run_dir)} as "
                              f"learner rank 0 writes it ({path} is missing or different "
                              f"here): {need}")
    raise CheckpointError(f"learner rank{'s' if len(blind) > 1 else ''} "
                          f"{', '.join(map(str, blind))} on another node do not see run.dir "
                          f"{os.path.abspath(run_dir)} as rank 0 writes it: {need}")
