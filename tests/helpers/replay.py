"""The replay harness as the tests run it: one replay (`python -m tsync_mcore.learner.replay`,
under torchrun for nproc > 1) or several in one launch (replay_many)."""

import json
import os
import subprocess
import sys

from tests.helpers.dist_util import parse_results
from tests.helpers.paths import ROOT
from tsync_mcore.util.net import free_port as _free_port


def replay(hf_dir, batch, out, nproc=2, *flags):
    cmd = [sys.executable, "-m", "tsync_mcore.learner.replay", "--model", hf_dir, "--batch", batch,
           "--out", out, *flags]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), "-m", "tsync_mcore.learner.replay", *cmd[3:]]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"replay failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def replay_many(jobs, d, nproc=2):
    """Several replays in one launch of nproc ranks; jobs: name → the replay command's
    arguments but --out (DIR/name). Each job is the command's main() with its own Policy and
    Learner (tests/helpers/workers/replay_many_worker.py): only the start-up (interpreter, torch,
    megatron: most of a small replay's time) is shared. Returns name → {summary, dir}."""
    path = write_jobs(jobs, d)
    worker = os.path.join(ROOT, "tests/helpers/workers/replay_many_worker.py")
    cmd = [sys.executable, worker, path]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), worker, path]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"replays failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return job_results(jobs, d, parse_results(p.stdout)[0]["summaries"])


def write_jobs(jobs, d) -> str:
    """The jobs' argument lists (each with its --out DIR/name) in a JSON file for a worker."""
    argvs = [[*args, "--out", os.path.join(d, name)] for name, args in jobs.items()]
    path = os.path.join(d, f"jobs_{next(iter(jobs))}.json")
    with open(path, "w") as f:
        json.dump(argvs, f)
    return path


def job_results(jobs, d, summaries) -> dict:
    """name → {summary, dir}: the jobs' summaries as a worker reported them, in order."""
    return {name: dict(summary=s, dir=os.path.join(d, name))
            for name, s in zip(jobs, summaries, strict=True)}


def run_jobs(jobs_path: str) -> list[dict]:
    """Worker side: the replay jobs of JOBS.json (write_jobs) in this process, in order, each
    the replay command's main() with its own Policy and Learner; their summaries."""
    import gc

    from tsync_mcore.learner import replay as replay_command
    with open(jobs_path) as f:
        jobs = json.load(f)
    summaries = []
    for argv in jobs:
        summaries.append(replay_command.main(argv))
        gc.collect()  # the previous job's model and accumulators, before the next one's
    return summaries
