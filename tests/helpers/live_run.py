"""A live run started as a user would: the rollout launcher and `nproc` learner ranks under
torchrun, on a config file, with the data rows the live dataset tests share."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.paths import ROOT
from tsync_mcore.util.net import free_port

# the live dataset runs' rows (test_data_live, test_judge_live): the reward counts digits
DIGIT_ROWS = [{"prompt": f"Write the digits of {n}.", "label": str(n), "topic": t}
              for n, t in ((314, "pi"), (271, "e"), (141, "sqrt2"), (173, "sqrt3"), (223, "sqrt5"))]

# one epoch is 8 rows, as many as a batch's groups with its reserves: every batch can reach
# its 2 hard rows however many easy ones come first (test_dynamic_sampling_live,
# test_replica_restart_live)
EASY_HARD_ROWS = [{"prompt": f"Write the digits of {n}.", "label": "easy" if i < 6 else "hard"}
                  for i, n in enumerate((314, 271, 141, 173, 223, 577, 161, 732))]


def start(config: str, run: str, sets: list[str], resume: bool = False, nproc: int = 2):
    """Rollout launcher + `nproc` learner ranks under torchrun (see finish); the config's
    rollout.n_learners must say the same."""
    sets = [f"run.dir={run}", f"publish.dir={run}/publish", f"channel.port={free_port()}",
            *sets]
    os.makedirs(run, exist_ok=True)
    common = ["--config", config, "--set", *sets]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    rollout = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch/rollout.py"), *common],
                               stdout=open(f"{run}/rollout.log", "a"), stderr=subprocess.STDOUT,
                               env=env, cwd=ROOT)
    learner = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--master-port", str(free_port()), os.path.join(ROOT, "launch/learner.py"),
         *common, *(["--resume"] if resume else [])],
        stdout=open(f"{run}/learner.out", "a"), stderr=open(f"{run}/learner.err", "a"),
        env=env, cwd=ROOT)
    return run, learner, rollout


def finish(started, check: bool = True) -> tuple[int, int]:
    """Waits for a start()ed run to end; asserts both sides exit 0 (check) and returns their
    exit codes."""
    run, learner, rollout = started
    try:
        rc_l = learner.wait(timeout=400)
        rc_r = rollout.wait(timeout=120)
    finally:
        for p in (learner, rollout):
            if p.poll() is None:
                p.kill()
                p.wait()
    log = open(f"{run}/rollout.log").read()[-3000:] + open(f"{run}/learner.err").read()[-3000:]
    assert not check or rc_l == 0 and rc_r == 0, log
    return rc_l, rc_r


def launch(config: str, run: str, sets: list[str], resume: bool = False,
           check: bool = True, nproc: int = 2) -> tuple[int, int]:
    """start() + finish(): one run to the end."""
    return finish(start(config, run, sets, resume, nproc), check)
