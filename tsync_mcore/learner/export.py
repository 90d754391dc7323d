"""A run's checkpoint as a Hugging Face model directory.

    python -m tsync_mcore.learner.export RUN_DIR [--step N] --out HF_DIR [--max-shard-size 5GB]

Reads RUN_DIR/config.yaml (`model.hf_dir`, `model.dtype`) and the checkpoint
RUN_DIR/checkpoints/step_N (default: the one `latest` names), merges the tensor-parallel
shards of one data-parallel replica into full Hugging Face tensors (the rules of
tsync_mcore/model/bridge/), and writes HF_DIR with

    model.safetensors  (or model-0000i-of-0000n.safetensors + model.safetensors.index.json
                        when larger than --max-shard-size)
    config.json        model.hf_dir's, with `dtype` set to the exported dtype
    generation_config.json, tokenizer files   copied from model.hf_dir (generation config
                        derived from config.json where model.hf_dir has none)

The weights keep the model's dtype (`model.dtype`: fp32 or bf16), the dtype the learner
trained and published them in. Runs on CPU, any TP, without torch.distributed.

Everything read is checked first, as a resume checks it (tsync_mcore/learner/checkpoint.py): the
`latest` pointer, meta.json, each rank file's digest and header, and that the model tensors
are exactly the ones this model has at this TP, with their shapes and dtype, finite, and
replicated ones equal on every TP rank. A refusal is one line `error: ...` and exit status
2, and nothing is written: HF_DIR must be absent or an empty directory; the directory is
built under a temporary name beside it and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from tsync_mcore.config import ConfigError, ModelConfig, from_dict
from tsync_mcore.util.safe_files import BadFile, read_json_object, regular_file

__all__ = ["ExportError", "export_checkpoint", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# What a tokenizer may consist of (any that model.hf_dir has is copied).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
DEFAULT_SHARD_SIZE = "5GB"  # transformers' save_pretrained default


class ExportError(BadFile):
    """The run, checkpoint or output directory cannot be exported; one line says why."""


def _megatron():
    """checkpoint and bridge, imported on first use: a refused run directory or --out is
    reported without Megatron's import, and its TE/Apex fallback notices are not printed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        from tsync_mcore.learner import checkpoint
        from tsync_mcore.model import bridge
    return checkpoint, bridge


# --------------------------------------------------------------------------- the run


def _model_config(run_dir: str) -> ModelConfig:
    """The `model:` section of the run's config.yaml, typed and checked."""
    if not os.path.isdir(run_dir):
        raise ExportError(f"run directory {run_dir}: missing or not a directory")
    path = os.path.join(run_dir, "config.yaml")
    try:
        regular_file(path)
    except BadFile:
        raise ExportError(f"run directory {run_dir}: no config.yaml (not a run directory the "
                          f"learner wrote)") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ExportError(f"{path}: not readable YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ExportError(f"{path}: no 'model:' section")
    try:
        model = from_dict(ModelConfig, data["model"], prefix="model.")
        model.validate()
    except ConfigError as e:
        raise ExportError(f"{path}: {e}") from None
    if not model.hf_dir:
        raise ExportError(f"{path}: model.hf_dir is empty (the config.json and tokenizer "
                          f"come from there)")
    return model


def _checkpoint_dir(run_dir: str, step: int | None) -> str:
    checkpoint, _ = _megatron()
    root = os.path.join(run_dir, "checkpoints")
    if step is None:
        ckpt = checkpoint.latest(run_dir)
        if ckpt is None:
            raise ExportError(f"run directory {run_dir}: no checkpoint ({root}/latest is "
                              f"missing)")
        return ckpt
    ckpt = os.path.join(root, f"step_{step}")
    if not os.path.lexists(ckpt):
        have = sorted((d for d in (os.listdir(root) if os.path.isdir(root) else [])
                       if re.fullmatch(r"step_\d+", d)), key=lambda d: int(d[5:]))
        raise ExportError(f"run directory {run_dir}: no checkpoint step_{step} (have: "
                          f"{', '.join(have) or 'none'})")
    return ckpt


# --------------------------------------------------------------------------- the weights


def _hf_shapes(spec) -> dict[str, tuple[int, ...]]:
    """Full HF parameter shapes of `spec` (what transformers builds for its config.json)."""
    h, hd = spec.hidden, spec.head_dim
    q, kv = spec.heads * hd, spec.kv_heads * hd
    per_layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,), "mlp.gate_proj.weight": (spec.ffn, h),
        "mlp.up_proj.weight": (spec.ffn, h), "mlp.down_proj.weight": (h, spec.ffn),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    # Qwen3-MoE (docs/guide/moe.md): the router, and per expert e the same three projections
    per_layer.update({"mlp.gate.weight": (spec.num_experts, h),
                      "mlp.experts.E.gate_proj.weight": (spec.moe_ffn, h),
                      "mlp.experts.E.up_proj.weight": (spec.moe_ffn, h),
                      "mlp.experts.E.down_proj.weight": (h, spec.moe_ffn)})
    top = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,),
           "lm_head.weight": (spec.vocab_size, h)}
    out = {}
    for name in _megatron()[1].hf_param_names(spec):
        m = re.fullmatch(r"model\.layers\.\d+\.(.+)", name)
        out[name] = per_layer[re.sub(r"experts\.\d+\.", "experts.E.", m.group(1))] if m \
            else top[name]
    return out


def _expected_local(spec, names: list[str], tp: int, where: str
                    ) -> dict[str, tuple[str, list[str], list[torch.Size]]]:
    """Megatron name -> (kind, HF names, local shape per TP rank), after checking that the
    names cover every HF parameter of the model exactly once."""
    _, bridge = _megatron()
    full = _hf_shapes(spec)
    out, covered = {}, {}
    for mname in names:
        try:
            kind, hf_names = bridge.weights.param_rule(mname)
        except KeyError:
            raise ExportError(f"{where}: unexpected model tensor {mname!r}") from None
        if spec.tie and hf_names == ["lm_head.weight"]:
            raise ExportError(f"{where}: {mname!r} present, but the model ties its embeddings")
        for n in hf_names:
            if n not in full:
                raise ExportError(f"{where}: model tensor {mname!r} maps to {n}, which this "
                                  f"{spec.arch} model does not have")
            if n in covered:
                raise ExportError(f"{where}: {mname!r} and {covered[n]!r} both hold {n}")
            covered[n] = mname
        # the bridge's own shard rule, on shape-only tensors
        meta = [torch.empty(full[n], device="meta") for n in hf_names]
        shapes = [bridge.weights.to_local(kind, meta, spec, r, tp).shape for r in range(tp)]
        out[mname] = (kind, hf_names, shapes)
    missing = [n for n in full if n not in covered]
    if missing:
        raise ExportError(f"{where}: no model tensor for {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return out


def _read_model_tensors(path: str) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of one rank file (optimizer state and RNG are not read)."""
    try:
        with safe_open(path, "pt", device="cpu") as f:
            return {k[len("model."):]: f.get_tensor(k) for k in f.keys()
                    if k.startswith("model.")}
    except Exception as e:  # safetensors raises several kinds; the file is refused either way
        raise ExportError(f"checkpoint {path}: unreadable ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


def _check_tensor(t: torch.Tensor, name: str, shape, dtype: torch.dtype, what: str,
                  where: str) -> None:
    """A rank file's model tensor has the shape and dtype this run gives it, and is finite."""
    if t.shape != shape or t.dtype != dtype:
        raise ExportError(f"{where}: tensor 'model.{name}' is {tuple(t.shape)} {t.dtype}; "
                          f"{what} in {dtype} has {tuple(shape)}")
    if not torch.isfinite(t).all():
        raise ExportError(f"{where}: tensor 'model.{name}' holds non-finite values")


def merged_weights(ckpt_dir: str, spec, dtype: torch.dtype
                   ) -> tuple[dict[str, torch.Tensor], dict]:
    """Full HF tensors (canonical HF order) of a checked checkpoint, and its meta.json.

    Reads ranks 0..tp-1: Megatron puts TP innermost, so they are TP ranks 0..tp-1 of data-
    parallel replica 0 (every replica holds the same model). `spec`: bridge.ModelSpec."""
    checkpoint, bridge = _megatron()
    meta = checkpoint.step_meta(ckpt_dir)
    tp = meta["tp"]
    shards: list[dict[str, torch.Tensor]] = []
    plan = None
    for r in range(tp):
        path = checkpoint.rank_file(ckpt_dir, r, meta)
        where = f"checkpoint {path}"
        tensors = _read_model_tensors(path)
        if meta.get("ep", 1) > 1:
            tensors = _with_all_experts(ckpt_dir, meta, spec, tensors, where)
        if plan is None:
            plan = _expected_local(spec, list(tensors), tp, where)
        odd = sorted(set(tensors) ^ set(plan))
        if odd:
            raise ExportError(f"{where}: model tensor {odd[0]!r} present on one TP rank only")
        for mname, (_, _, shapes) in plan.items():
            _check_tensor(tensors[mname], mname, shapes[r], dtype, f"this model at TP={tp}",
                          where)
        shards.append(tensors)
    order = {n: i for i, n in enumerate(bridge.hf_param_names(spec))}
    out: dict[str, torch.Tensor] = {}
    for mname, (kind, hf_names, _) in plan.items():
        parts = [s.pop(mname) for s in shards]
        if kind == "rep" and any(not torch.equal(parts[0], p) for p in parts[1:]):
            raise ExportError(f"checkpoint {ckpt_dir}: replicated tensor 'model.{mname}' "
                              f"differs between TP ranks")
        # the bridge's shard rules (private there: shared with its TP-gathering export_hf)
        for name, full in zip(hf_names, bridge.weights.from_shards(kind, parts, spec)):
            out[name] = full.contiguous()
    return dict(sorted(out.items(), key=lambda kv: order[kv[0]])), meta


def _with_all_experts(ckpt_dir: str, meta: dict, spec, tensors: dict[str, torch.Tensor],
                      where: str) -> dict[str, torch.Tensor]:
    """Rank 0's model tensors with every expert-parallel rank's experts under their global
    index (local expert j of EP rank r is expert r·E/ep + j), as one rank would hold them
    at ep 1. MoE training runs at TP 1, where megatron puts EP ranks 0..ep−1 on ranks
    0..ep−1: each file's header says which EP rank wrote it, and is checked."""
    checkpoint, bridge = _megatron()
    ep = meta["ep"]
    if meta["tp"] != 1:
        raise ExportError(f"{where}: ep {ep} with tp {meta['tp']}; expert-parallel export "
                          f"reads TP 1 checkpoints")
    local = spec.num_experts // ep
    out = {n: t for n, t in tensors.items() if not bridge.is_expert_param(n)}
    for r in range(ep):
        path = checkpoint.rank_file(ckpt_dir, r, meta)
        got = _checked_ep_rank(path, r)
        part = tensors if r == 0 else _read_model_tensors(path)
        for n, t in part.items():
            if not bridge.is_expert_param(n):
                continue
            m = re.search(r"\.local_experts\.(\d+)\.", n)
            j = int(m.group(1))
            if j >= local:
                raise ExportError(f"checkpoint {path}: local expert {j}, but EP rank {got} "
                                  f"holds {local}")
            out[n.replace(m.group(0), f".local_experts.{got * local + j}.")] = t
    return out


def _checked_ep_rank(path: str, r: int) -> int:
    with safe_open(path, "pt", device="cpu") as f:
        got = (f.metadata() or {}).get("ep_rank")
    if got != str(r):
        raise ExportError(f"checkpoint {path}: header ep_rank={got!r}, expected {r} (rank {r} "
                          f"of a TP 1 expert-parallel run)")
    return r


ADAPTER_DIR = "lora_adapter"  # a LoRA run's PEFT adapter, inside the exported directory


def lora_weights(ckpt_dir: str, spec, hf_dir: str, dtype: torch.dtype
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """A LoRA run's checkpoint: (merged HF tensors W + s·B·A of the base in `hf_dir`, the
    full PEFT adapter tensors, meta.json). The rank files hold the adapters only."""
    checkpoint, bridge = _megatron()
    from tsync_mcore.model import lora
    meta = checkpoint.step_meta(ckpt_dir)
    spec_l, tp = meta["lora"], meta["tp"]
    zeros = {n: torch.empty(s, device="meta") for n, s in lora.peft_shapes(spec, spec_l).items()}
    shards = []
    for r in range(tp):
        path = checkpoint.rank_file(ckpt_dir, r, meta)
        where = f"checkpoint {path}"
        tensors = _read_model_tensors(path)
        want = lora.to_local(zeros, spec, spec_l, tp, r)
        odd = sorted(set(tensors) ^ set(want))
        if odd:
            raise ExportError(f"{where}: model tensor {odd[0]!r} is "
                              f"{'missing' if odd[0] in want else 'not an adapter of this run'}"
                              f" (r={spec_l.rank}, targets {list(spec_l.targets)})")
        for name, w in want.items():
            _check_tensor(tensors[name], name, w.shape, dtype, f"this adapter at TP={tp}",
                          where)
        shards.append(tensors)
    try:
        adapter = lora.from_local(shards, spec, spec_l)
    except ValueError as e:
        raise ExportError(f"checkpoint {ckpt_dir}: {e}") from None
    base = bridge.load_hf_state_dict(hf_dir)
    missing = [n for n in bridge.hf_param_names(spec) if n not in base]
    if missing:
        raise ExportError(f"model.hf_dir {hf_dir}: missing base weight {missing[0]}")
    base = {n: base[n].to(dtype) for n in bridge.hf_param_names(spec)}
    return lora.merge_hf(base, adapter, spec_l), adapter, meta


# --------------------------------------------------------------------------- the directory


def _check_out(out: str, replace: bool) -> None:
    if os.path.islink(out):
        raise ExportError(f"--out {out}: is a symlink")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ExportError(f"--out {out}: exists and is not a directory")
        if os.listdir(out) and not replace:
            raise ExportError(f"--out {out}: exists and is not empty (nothing was written)")
    parent = os.path.dirname(os.path.abspath(out))
    probe = parent
    while not os.path.exists(probe):  # the nearest existing ancestor must be writable
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ExportError(f"--out {out}: {probe} is not a writable directory")


def _hf_config(hf_dir: str, dtype: torch.dtype) -> dict:
    cfg = read_json_object(os.path.join(hf_dir, "config.json"))
    cfg["dtype"] = HF_DTYPE_NAMES[dtype]  # transformers 5 reads `dtype`, older `torch_dtype`
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = HF_DTYPE_NAMES[dtype]
    return cfg


def _write_weights(tmp: str, tensors: dict[str, torch.Tensor], max_shard_size) -> int:
    """safetensors file(s) as transformers' save_pretrained writes them; returns the count."""
    from huggingface_hub import split_torch_state_dict_into_shards
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for fname, names in split.filename_to_tensors.items():
        path = os.path.join(tmp, fname)
        save_file({n: tensors[n] for n in names}, path, metadata={"format": "pt"})
        os.chmod(path, 0o644)  # save_file creates 0600; the directory's mode decides access
    if split.is_sharded:
        index = {"metadata": {**split.metadata,
                              "total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return len(split.filename_to_tensors)


def _copy_side_files(hf_dir: str, tmp: str) -> list[str]:
    """Tokenizer files and generation config from model.hf_dir (links followed: a hub
    cache's snapshot directory is links into its blob store)."""
    copied = []
    for name in TOKENIZER_FILES + ("generation_config.json",):
        src = os.path.join(hf_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(tmp, name))
            copied.append(name)
    if "generation_config.json" not in copied:
        from transformers import AutoConfig, GenerationConfig
        try:
            gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp))
        except Exception as e:  # transformers' errors vary; the export is refused either way
            raise ExportError(f"{os.path.join(hf_dir, 'config.json')}: transformers cannot "
                              f"read it to derive generation_config.json ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
        gen.save_pretrained(tmp)
    return copied


def export_checkpoint(run_dir: str, out: str, step: int | None = None, *,
                      replace: bool = False, max_shard_size: int | str = DEFAULT_SHARD_SIZE
                      ) -> dict:
    """Write the HF directory of `run_dir`'s checkpoint `step` (default: latest) to `out`.

    `replace`: an existing non-empty `out` is replaced (the trainer's RUN_DIR/hf); otherwise
    it is refused. Returns a summary. Raises ExportError / CheckpointError / ModelDirError
    (all BadFile) before anything is written.
    """
    t0 = time.perf_counter()
    _check_out(out, replace)
    model = _model_config(run_dir)
    ckpt = _checkpoint_dir(run_dir, step)
    spec = _megatron()[1].load_hf_config(model.hf_dir)  # ModelDirError names model.hf_dir's file
    dtype = DTYPES[model.dtype]
    adapter = None
    if "lora" in _megatron()[0].step_meta(ckpt):  # a LoRA run: frozen base + its adapter
        tensors, adapter, meta = lora_weights(ckpt, spec, model.hf_dir, dtype)
    else:
        tensors, meta = merged_weights(ckpt, spec, dtype)
    cfg = _hf_config(model.hf_dir, dtype)

    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    old = None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # an ordinary directory, not mkdtemp's 0700
        n_files = _write_weights(tmp, tensors, max_shard_size)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        copied = _copy_side_files(model.hf_dir, tmp)
        if adapter is not None:
            from tsync_mcore.model import lora
            lora.write_peft_dir(os.path.join(tmp, ADAPTER_DIR), meta["lora"], adapter,
                                base_model=os.path.abspath(model.hf_dir), dtype=dtype)
        if os.path.isdir(out) and os.listdir(out):  # replace=True: set the old one aside
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
            os.rename(out, os.path.join(old, "hf"))
        os.rename(tmp, out)  # onto an absent or empty directory: atomic
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.exists(out):
            os.rename(os.path.join(old, "hf"), out)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return {"out": out, "checkpoint": ckpt, "version": meta["version"], "tp": meta["tp"],
            "dtype": HF_DTYPE_NAMES[dtype], "tensors": len(tensors), "files": n_files,
            "copied": copied, "seconds": round(time.perf_counter() - t0, 3)}


# --------------------------------------------------------------------------- command line


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*", text)
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB or 500MB, got {text!r}")
    unit = m.group(2) or "B"
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    return int(m.group(1)) * scale


def _step(text: str) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]{0,17}", text):
        raise argparse.ArgumentTypeError(f"expected a policy version (0, 1, 2, ...), got "
                                         f"{text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tsync_mcore.learner.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="the run directory (run.dir): config.yaml and checkpoints/")
    p.add_argument("--step", type=_step, default=None, metavar="N",
                   help="export checkpoints/step_N (policy version N); default: the checkpoint "
                        "checkpoints/latest names")
    p.add_argument("--out", required=True, metavar="HF_DIR",
                   help="the Hugging Face directory to write; must not exist or be empty")
    p.add_argument("--max-shard-size", type=_size, default=DEFAULT_SHARD_SIZE, metavar="SIZE",
                   help="split the weights into files of at most SIZE (e.g. 5GB, 500MB; "
                        f"default {DEFAULT_SHARD_SIZE}) with a model.safetensors.index.json")
    args = p.parse_args(argv)
    try:
        summary = export_checkpoint(args.run_dir, args.out, args.step,
                                    max_shard_size=args.max_shard_size)
    except (BadFile, OSError) as e:
        print(f"error: export: {e}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
