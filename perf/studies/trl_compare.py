"""TRL's `GRPOTrainer` (1.16.0) against tsync-mcore on the same work, one after the other on
the whole machine: the same model, rows (in the order tsync-mcore's sampler visits them),
reward function, group size, batch, completion length, temperature, optimizer and loss.

    python -m perf.studies.trl_compare --model /tmp/real/model \\
        --train /tmp/real/train.jsonl --eval /tmp/real/eval.jsonl \\
        --reward /tmp/real/reward.py:score --updates 8 --out runs/trl-compare

1. TRL 1.16.0 goes into its own virtual environment (--venv, default runs/trl-venv; kept
   when `import trl` there gives 1.16.0). The venv sees this interpreter's packages through
   a .pth file and pip gets torch and transformers pinned to the installed versions, so it
   adds trl (and whatever trl needs that is missing) and never a second torch.
2. TRL runs in that venv (perf/studies/trl_runner.py): one optimizer step per batch of
   groups × group-size completions, generated at once with transformers (no vLLM),
   num_iterations 1, no KL, constant LR, FP32 on CPU (BF16 autocast when tsync-mcore runs
   model.dtype=bf16: both sides then train in BF16). Per update: the wall time from the
   trainer's step begin to its step end, and the batch's reward mean.
3. tsync-mcore runs `launch/run.py` on the same settings (the config is written to
   OUT/tsync.yaml; --tsync-set adds overrides, which the TRL side follows too where they
   name shared settings). Per update: `step_wall_time_s` and `reward_mean` of
   metrics.jsonl. --tsync-placement split (default) pins the rollout and the learner to
   disjoint halves of the cores (launch.rollout_cpus / learner_cpus), shared lets both use
   every core.
4. The base model and both final checkpoints are evaluated alike: greedy decoding with
   transformers in FP32 on the eval rows, scored by the same reward function (mean reward:
   the accuracy for a 0/1 scorer).
5. OUT/result.json: per-update rows of both, the mean wall time per update over updates
   2..N (the first is warm-up) and their ratio, the evaluation; a markdown table on stdout.

The loss: tsync-mcore's learner.token_norm / adv_std / adv_eps (defaults here: token_mean,
unbiased, 1e-4) map to TRL's loss_type / scale_rewards as docs/design/objectives.md
tabulates (`trl_loss`); a setting without a TRL counterpart is refused. A bad input is one
line `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import shutil
import site
import subprocess
import sys
import time
from typing import Any

from perf import ROOT
from perf.bench import schedule_runs
from perf.studies.trl_runner import TRL_VERSION, score

TRL_ADV_EPS = 1e-4  # TRL adds this to σ in (r − μ)/(σ + ε), hard-coded (grpo_trainer.py)
ON_POLICY = ("sync", "group_ready", "thundersync")  # every batch sampled by θ_k, as TRL's


class CompareError(Exception):
    """The comparison cannot run as asked; the message is one line."""


# --- settings: tsync-mcore's config → TRL's GRPOConfig -----------------------------------

def trl_loss(lc: Any, max_completion_length: int) -> dict[str, str]:
    """TRL's loss_type and scale_rewards for tsync-mcore's learner settings `lc`
    (LearnerConfig), per docs/design/objectives.md ("Against the peers", TRL 1.16.0)."""
    if lc.objective == "grpo":
        if lc.adv_std != "unbiased":
            raise CompareError(f"learner.adv_std={lc.adv_std}: TRL divides by the unbiased "
                               f"(÷ m − 1) group std; set learner.adv_std=unbiased")
        if not math.isclose(lc.adv_eps, TRL_ADV_EPS, rel_tol=1e-9):
            raise CompareError(f"learner.adv_eps={lc.adv_eps:g}: TRL's ε is {TRL_ADV_EPS:g}, "
                               f"hard-coded; set learner.adv_eps={TRL_ADV_EPS:g}")
        scale = "group"
    elif lc.objective == "dr_grpo":
        scale = "none"  # A = r − μ
    else:
        raise CompareError(f"learner.objective={lc.objective}: TRL's GRPOTrainer has no "
                           f"counterpart (grpo or dr_grpo)")
    # TRL's groups are always full, so tsync-mcore's per-group weight 1/(n_groups·m_G·L_i)
    # ("trajectory") is its per-sequence 1/(B·L_i) ("seq_mean_token_mean")
    loss = {"token_mean": "dapo", "seq_mean_token_mean": "grpo",
            "trajectory": "grpo"}.get(lc.token_norm)
    if lc.token_norm == "seq_mean_token_sum_norm":
        if lc.token_norm_constant != max_completion_length:
            raise CompareError(f"learner.token_norm_constant={lc.token_norm_constant:g}: "
                               f"TRL's dr_grpo divides by max_completion_length "
                               f"({max_completion_length}); set it to that")
        loss = "dr_grpo"
    if loss is None:
        raise CompareError(f"learner.token_norm={lc.token_norm}: no TRL loss_type divides "
                           f"alike; use token_mean, seq_mean_token_mean, trajectory or "
                           f"seq_mean_token_sum_norm")
    return {"loss_type": loss, "scale_rewards": scale}


def check_comparable(cfg: Any) -> None:
    """The tsync-mcore settings TRL's GRPOTrainer can run too; CompareError names the key."""
    lc, rc, oc = cfg.learner, cfg.rollout, cfg.optim
    checks = [
        (lc.schedule in ON_POLICY, "learner.schedule",
         (f"{lc.schedule} trains on an older policy's samples; TRL's are θ_k's "
          f"(use one of {', '.join(ON_POLICY)})")),
        (lc.is_correction == "none", "learner.is_correction",
         "TRL without vLLM samples and trains with one model: set none"),
        (oc.lr_schedule == "constant" and oc.warmup_updates == 0, "optim.lr_schedule",
         "the comparison runs a constant LR without warm-up"),
        (not cfg.model.use_lora, "model.lora", "the comparison trains every weight"),
        (cfg.model.dtype in ("fp32", "bf16"), "model.dtype",
         "the comparison runs fp32, or bf16 on both sides"),
        (rc.env == "dataset", "rollout.env", "TRL gets data.train's rows: use dataset"),
        (cfg.data.chat_template, "data.chat_template",
         "TRL's prompts are chat messages: set true"),
        (rc.temperature > 0, "rollout.temperature", "GRPO samples: must be > 0"),
        (rc.group_size >= 2, "rollout.group_size", "TRL needs num_generations >= 2"),
    ]
    for ok, key, why in checks:
        if not ok:
            raise CompareError(f"{key}: {why}")


def grpo_kwargs(cfg: Any, out_dir: str, precision: str = "") -> dict[str, Any]:
    """GRPOConfig's keyword arguments for the work tsync-mcore's `cfg` describes;
    `precision` (fp32 | bf16) sets TRL's own ("": as tsync-mcore's model.dtype)."""
    check_comparable(cfg)
    rc, oc = cfg.rollout, cfg.optim
    batch = rc.groups_per_batch * rc.group_size
    return dict(
        output_dir=out_dir, seed=cfg.seed, max_steps=cfg.run.updates,
        # One update = one optimizer step on exactly the batch's completions: they are
        # generated at once (generation_batch_size = per_device_train_batch_size ×
        # steps_per_generation = batch) and trained as one micro-batch, once (num_iterations
        # 1: the ratio is 1, so clipping never acts, as in tsync-mcore's on-policy surrogate)
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=rc.group_size,
        # rows come in tsync-mcore's sampler order (trl_runner's dataset), one group each
        shuffle_dataset=False,
        max_completion_length=rc.max_tokens_per_turn, temperature=rc.temperature,
        top_p=1.0, top_k=0, beta=0.0, **trl_loss(cfg.learner, rc.max_tokens_per_turn),
        learning_rate=oc.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=oc.beta1, adam_beta2=oc.beta2, adam_epsilon=oc.eps,
        weight_decay=oc.weight_decay, max_grad_norm=oc.clip_grad,
        # the precision tsync-mcore's model.dtype names (TRL: FP32 weights, BF16 autocast
        # for bf16, as its Trainer runs it); no gradient checkpointing, no vLLM
        use_cpu=True, bf16=(precision or cfg.model.dtype) == "bf16", fp16=False,
        gradient_checkpointing=False, use_vllm=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)


def split_cpus(cores: list[int]) -> tuple[list[int], list[int]]:
    """Disjoint rollout and learner cores: the first half, the rest."""
    if len(cores) < 2:
        raise CompareError(f"--tsync-placement split needs 2 cores, this process may use "
                           f"{len(cores)}; use --tsync-placement shared")
    half = len(cores) // 2
    return cores[:half], cores[half:]


def cpu_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def tsync_config(args: argparse.Namespace, run_dir: str, cores: list[int]) -> dict[str, Any]:
    """tsync-mcore's config for the comparison (before --tsync-set)."""
    cfg: dict[str, Any] = {
        "seed": args.seed,
        "model": {"hf_dir": args.model, "dtype": "fp32"},
        "optim": {"lr": args.lr},
        "learner": {"objective": "grpo", "schedule": args.tsync_schedule,
                    "token_norm": "token_mean", "adv_std": "unbiased",
                    "adv_eps": TRL_ADV_EPS},
        "run": {"dir": run_dir, "updates": args.updates, "save_every": 0, "export_hf": True,
                "eval_every": 0},
        # generous: a CPU update of a real model can take minutes
        "channel": {"timeout_s": 1800, "ack_timeout_s": 1800},
        "rollout": {"n_learners": 1, "env": "dataset", "groups_per_batch": args.groups,
                    "group_size": args.group_size, "max_turns": 1,
                    "max_tokens_per_turn": args.max_tokens, "temperature": args.temperature},
        "data": {"train": args.train, "eval": args.eval, "prompt_key": args.prompt_key,
                 "label_key": args.label_key, "shuffle": True},
        "reward": {"function": args.reward},
    }
    if args.tsync_placement == "split":
        rollout, learner = split_cpus(cores)
        cfg["launch"] = {"rollout_cpus": cpu_list(rollout), "learner_cpus": cpu_list(learner)}
    return cfg


# --- results -------------------------------------------------------------------------------

def tsync_rows(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl rows → per-update rows (updates that trained only)."""
    return [{"update": m["step"], "wall_s": m.get("step_wall_time_s"),
             "reward_mean": m.get("reward_mean")}
            for m in metrics if m.get("ok", True)]


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(trl: list[dict[str, Any]], tsync: list[dict[str, Any]],
              skip: int = 1) -> dict[str, Any]:
    """Mean wall time per update over updates skip+1..N of each side (None when a side has
    no such update), their ratio tsync/TRL (< 1: tsync-mcore is faster), mean rewards."""
    t = _mean([r["wall_s"] for r in trl[skip:]])
    s = _mean([r["wall_s"] for r in tsync[skip:]])
    return {"skip_first": skip, "trl_updates": len(trl), "tsync_updates": len(tsync),
            "trl_wall_mean_s": t, "tsync_wall_mean_s": s,
            "ratio_tsync_over_trl": s / t if t and s is not None else None,
            "trl_reward_mean": _mean([r["reward_mean"] for r in trl]),
            "tsync_reward_mean": _mean([r["reward_mean"] for r in tsync])}


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    trl = {r["update"]: r for r in result.get("trl", {}).get("rows", [])}
    ts = {r["update"]: r for r in result.get("tsync", {}).get("rows", [])}
    lines = ["| update | TRL wall (s) | TRL reward | tsync wall (s) | tsync reward |",
             "|---:|---:|---:|---:|---:|"]
    for k in sorted(set(trl) | set(ts)):
        a, b = trl.get(k, {}), ts.get(k, {})
        lines.append(f"| {k} | {_f(a.get('wall_s'))} | {_f(a.get('reward_mean'), '.3f')} | "
                     f"{_f(b.get('wall_s'))} | {_f(b.get('reward_mean'), '.3f')} |")
    s = result["summary"]
    first = s["skip_first"] + 1
    lines += ["", (f"mean wall per update, updates {first}..N: TRL "
                   f"{_f(s['trl_wall_mean_s'])} s, tsync-mcore {_f(s['tsync_wall_mean_s'])} s, "
                   f"ratio tsync/TRL {_f(s['ratio_tsync_over_trl'], '.3f')}")]
    walls = [result.get(k, {}).get("run_wall_s") for k in ("trl", "tsync")]
    lines.append(f"whole runs (start-up, saving included): TRL {_f(walls[0], '.0f')} s, "
                 f"tsync-mcore {_f(walls[1], '.0f')} s")
    ev = result.get("eval")
    if ev:
        lines += ["", (f"greedy eval mean reward on {ev['n']} rows: before "
                       f"{_f(ev.get('before'), '.3f')}, after TRL {_f(ev.get('trl'), '.3f')}, "
                       f"after tsync-mcore {_f(ev.get('tsync'), '.3f')}")]
    return "\n".join(lines)


# --- the TRL virtual environment ---------------------------------------------------------

def _venv_version(py: str, module: str) -> str | None:
    r = subprocess.run([py, "-c", f"import {module}; print({module}.__version__)"],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_venv(venv: str, find_links: str = "") -> str:
    """The venv's interpreter, with TRL_VERSION importable and this interpreter's torch."""
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and _venv_version(py, "trl") == TRL_VERSION:
        return py
    print(f"trl_compare: installing trl=={TRL_VERSION} into {venv}", flush=True)
    if not os.path.exists(py):
        # no pip of its own: this interpreter's pip installs into it (pip --python)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([py, "-c", where], capture_output=True, text=True,
                             check=True).stdout.strip()
    # this interpreter's packages (torch, transformers, accelerate, datasets, tsync-mcore's
    # own dependencies) seen from the venv, after its own
    with open(os.path.join(purelib, "_tsync_project.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    # pinned to what is installed: pip must not resolve torch anew (a CUDA build by default)
    constraints = os.path.join(venv, "constraints.txt")
    with open(constraints, "w") as f:
        f.writelines(f"{pkg}=={importlib.metadata.version(pkg)}\n"
                     for pkg in ("torch", "transformers"))
    cmd = [sys.executable, "-m", "pip", "--python", py, "--disable-pip-version-check", "-q",
           "install", "-c", constraints, f"trl=={TRL_VERSION}"]
    if find_links:
        cmd[-1:-1] = ["--find-links", find_links]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise CompareError(f"pip could not install trl=={TRL_VERSION} into {venv} (above)")
    got, torch_there = _venv_version(py, "trl"), _venv_version(py, "torch")
    import torch
    if got != TRL_VERSION or torch_there != torch.__version__:
        raise CompareError(f"{venv}: trl {got}, torch {torch_there} after pip; expected "
                           f"{TRL_VERSION} and {torch.__version__}")
    return py


# --- the runs -----------------------------------------------------------------------------

def _fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def run_trl(py: str, cfg: Any, order: list[int], out: str,
            precision: str = "") -> dict[str, Any]:
    out = _fresh(out)
    spec = {"model": cfg.model.hf_dir, "train": cfg.data.train, "order": order,
            "prompt_key": cfg.data.prompt_key, "label_key": cfg.data.label_key,
            "system_prompt": cfg.data.system_prompt, "reward": cfg.reward.function,
            "out": out, "grpo": grpo_kwargs(cfg, out, precision)}
    path = os.path.join(out, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f, indent=1)
    env = dict(schedule_runs.env(), PYTHONUNBUFFERED="1")
    print(f"== TRL {TRL_VERSION}: {cfg.run.updates} updates ({spec['grpo']['loss_type']}, "
          f"scale_rewards {spec['grpo']['scale_rewards']})", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run([py, "-m", "perf.studies.trl_runner", path], cwd=ROOT, env=env,
                        check=False).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise CompareError(f"the TRL run stopped with exit status {rc} (its output above)")
    with open(os.path.join(out, "trl_result.json")) as f:
        res = json.load(f)
    return {**res, "run_wall_s": wall, "grpo_config": spec["grpo"]}


def run_tsync(cfg_path: str, sets: list[str], run_dir: str) -> dict[str, Any]:
    """tsync-mcore's run (the schedule its config names) through the run-per-schedule driver."""
    print(f"== tsync-mcore: launch/run.py --config {cfg_path} {' '.join(sets)}", flush=True)
    run = schedule_runs.launch("tsync", cfg_path, sets, run_dir)
    if run.failed:
        raise CompareError(f"the tsync-mcore run stopped ({run.failed})")
    return {"rows": tsync_rows(run.rows), "run_wall_s": run.wall_s,
            "checkpoint": os.path.join(run_dir, "hf"), "config": cfg_path, "sets": sets}


def evaluate(model_dir: str, rows: list[Any], fn: Any, system_prompt: str,
             max_tokens: int, batch: int = 16) -> float:
    """Mean reward of greedy answers (transformers, FP32, at most `max_tokens` each)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tsync_mcore.data import render_prompt
    from tsync_mcore.rewards.call import parse_result

    tok = AutoTokenizer.from_pretrained(model_dir)
    # safetensors only: a model directory is untrusted input, and .bin files are pickles
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 use_safetensors=True).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=sorted(eos), pad_token_id=pad)
    scores = []
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        ids = [render_prompt(tok, r, system_prompt) for r in chunk]
        width = max(map(len, ids))  # left-padded, so every answer starts at `width`
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask,
                                 generation_config=gen)
        for r, seq in zip(chunk, out[:, width:].tolist()):
            end = next((j for j, t in enumerate(seq) if t in eos), len(seq))
            text = tok.decode(seq[:end], skip_special_tokens=True)
            scores.append(score(fn, r, text, parse_result))
    return sum(scores) / len(scores)


# --- main ---------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/models/smollm2-135m-instruct",
                   help="Hugging Face model directory (default: make real-model's)")
    p.add_argument("--train", required=True, help="training rows (.jsonl/.json/.parquet)")
    p.add_argument("--eval", default="", help="evaluation rows ('' : no evaluation)")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--label-key", default="answer")
    p.add_argument("--reward", required=True,
                   help="path/file.py:function (or a tsync-mcore built-in), called as "
                        "fn(prompt=, response=, label=, meta=)")
    p.add_argument("--updates", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) per batch")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=24, help="completion tokens at most")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-5, help="constant learning rate")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-n", type=int, default=0, help="evaluate the first N rows (0: all)")
    p.add_argument("--out", default="runs/trl-compare",
                   help="output directory: result.json, trl/, tsync/ (default runs/trl-compare)")
    p.add_argument("--venv", default="runs/trl-venv", help="TRL's virtual environment")
    p.add_argument("--find-links", default="",
                   help="a directory pip also looks in for the trl wheel")
    p.add_argument("--skip-trl", action="store_true",
                   help="no TRL run (its part of an earlier OUT/result.json is kept)")
    p.add_argument("--skip-tsync", action="store_true",
                   help="no tsync-mcore run (its part of an earlier OUT/result.json is kept)")
    p.add_argument("--trl-precision", choices=("", "fp32", "bf16"), default="",
                   help="TRL's precision (bf16: FP32 weights under BF16 autocast); default: "
                        "tsync-mcore's model.dtype")
    p.add_argument("--tsync-schedule", choices=ON_POLICY, default="thundersync")
    p.add_argument("--tsync-placement", choices=("split", "shared"), default="split",
                   help="split: rollout and learner on disjoint halves of the cores "
                        "(default); shared: both on every core")
    p.add_argument("--tsync-set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="more tsync-mcore config overrides (as launch/run.py --set); shared "
                        "settings (learner.token_norm, optim.*, data.*) apply to TRL too")
    return p.parse_args(argv)


def _check_inputs(args: argparse.Namespace) -> None:
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise CompareError(f"--model {args.model}: not a Hugging Face model directory (no "
                           f"config.json; `make real-model` writes the default)")
    for flag, path in (("--train", args.train), ("--eval", args.eval)):
        if path and not os.path.exists(path):
            raise CompareError(f"{flag} {path}: no such file")
    for flag, v, low in (("--updates", args.updates, 1), ("--groups", args.groups, 1),
                         ("--group-size", args.group_size, 2),
                         ("--max-tokens", args.max_tokens, 1), ("--eval-n", args.eval_n, 0)):
        if v < low:
            raise CompareError(f"{flag} must be >= {low}, got {v}")
    if not (args.lr > 0 and args.temperature > 0):
        raise CompareError("--lr and --temperature must be > 0")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for key in ("model", "train", "eval", "out", "venv"):
        if getattr(args, key):
            setattr(args, key, os.path.abspath(getattr(args, key)))
    if ".py:" in args.reward:  # a file spec, from wherever this is run
        where, _, name = args.reward.rpartition(":")
        args.reward = f"{os.path.abspath(where)}:{name}"
    try:
        result = compare(args)
    except CompareError as e:
        print(f"error: trl_compare: {e}", file=sys.stderr)
        return 2
    print(markdown(result))
    return 0


def compare(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    from tsync_mcore.config import ConfigError, load_config, parse_overrides
    from tsync_mcore.data import DataError, EpochSampler, load_prompts, render_prompt
    from tsync_mcore.rewards.load import RewardError, load_reward_fn

    _check_inputs(args)
    os.makedirs(args.out, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    cfg_path = os.path.join(args.out, "tsync.yaml")
    run_dir = os.path.join(args.out, "tsync")
    base = tsync_config(args, run_dir, cores)

    def load(doc: dict[str, Any]) -> Any:
        with open(cfg_path, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        try:
            return load_config(cfg_path, parse_overrides(args.tsync_set))
        except ConfigError as e:
            raise CompareError(str(e)) from None

    cfg = load(base)  # data.*, reward.* as --tsync-set may have changed them
    try:
        fn = load_reward_fn(cfg.reward.function, cfg.reward)
        train = load_prompts(cfg.data.train, cfg.data)
        evals = load_prompts(cfg.data.eval, cfg.data) if cfg.data.eval else None
    except (RewardError, DataError) as e:
        raise CompareError(str(e)) from None
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    # tsync-mcore refuses a prompt that leaves no room for the answer: room for the longest
    longest = max(len(render_prompt(tok, ps.row(i), cfg.data.system_prompt))
                  for ps in filter(None, (train, evals)) for i in range(len(ps)))
    base["rollout"]["max_total_tokens"] = longest + cfg.rollout.max_tokens_per_turn
    cfg = load(base)
    check_comparable(cfg)
    trl_loss(cfg.learner, cfg.rollout.max_tokens_per_turn)  # refused before any run starts

    old: dict[str, Any] = {}
    old_path = os.path.join(args.out, "result.json")
    if os.path.exists(old_path):
        with open(old_path) as f:
            old = json.load(f)
    result: dict[str, Any] = {"settings": {
        "model": cfg.model.hf_dir, "train": cfg.data.train, "eval": cfg.data.eval,
        "reward": cfg.reward.function, "updates": cfg.run.updates,
        "groups": cfg.rollout.groups_per_batch, "group_size": cfg.rollout.group_size,
        "max_tokens": cfg.rollout.max_tokens_per_turn, "temperature": cfg.rollout.temperature,
        "lr": cfg.optim.lr, "seed": cfg.seed, "cores": len(cores),
        "learner": {k: getattr(cfg.learner, k) for k in
                    ("objective", "schedule", "token_norm", "adv_std", "adv_eps")},
        "launch": {"rollout_cpus": cfg.launch.rollout_cpus,
                   "learner_cpus": cfg.launch.learner_cpus},
        # tsync-mcore's learner and rollout precision, and TRL's (BF16: autocast)
        "precision": {"tsync_learner": cfg.model.dtype, "tsync_autocast": cfg.model.autocast,
                      "tsync_rollout": cfg.rollout.dtype,
                      "trl": args.trl_precision or cfg.model.dtype}}}
    # the rows tsync-mcore's rollout visits: group g of batch k is data position k·G + g
    sampler = EpochSampler(len(train), cfg.seed, cfg.data.shuffle)
    order = [sampler.index(p) for p in range(cfg.run.updates * cfg.rollout.groups_per_batch)]
    if (args.skip_trl or args.skip_tsync) and old and old.get("settings") != result["settings"]:
        print(f"trl_compare: {old_path} is for other settings; its runs are not reused",
              flush=True)
        old = {}
    if args.skip_trl:
        if "trl" in old:
            result["trl"] = old["trl"]
    else:
        py = ensure_venv(args.venv, args.find_links)
        result["trl"] = run_trl(py, cfg, order, os.path.join(args.out, "trl"),
                                args.trl_precision)
    if args.skip_tsync:
        if "tsync" in old:
            result["tsync"] = old["tsync"]
    else:
        result["tsync"] = run_tsync(cfg_path, args.tsync_set, run_dir)
    result["summary"] = summarize(result.get("trl", {}).get("rows", []),
                                  result.get("tsync", {}).get("rows", []))
    if evals is not None:
        rows = [evals.row(i) for i in range(len(evals))][:args.eval_n or None]
        ev: dict[str, Any] = {"n": len(rows), "greedy": True,  # mean reward per checkpoint
                              "max_tokens": cfg.rollout.max_tokens_per_turn}
        for name, path in (("before", cfg.model.hf_dir),
                           ("trl", result.get("trl", {}).get("checkpoint")),
                           ("tsync", result.get("tsync", {}).get("checkpoint"))):
            if path and os.path.isfile(os.path.join(path, "config.json")):
                ev[name] = evaluate(path, rows, fn, cfg.data.system_prompt,
                                    cfg.rollout.max_tokens_per_turn)
        result["eval"] = ev
    with open(old_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"trl_compare: {old_path}", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
