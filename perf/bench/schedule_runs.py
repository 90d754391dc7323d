"""One real run per schedule, one after the other, and what each left behind: the driver of
`make compare` (perf/studies/compare.py), Figure 1 in miniature (perf/studies/figure1.py)
and the tsync-mcore side of the TRL side-by-side (perf/studies/trl_compare.py).

A run is `launch/run.py --config CONFIG --set ...` in a child process started from the
checkout's root, with the checkout first on its import path. Its run directory holds
metrics.jsonl (one row per update) and, when the run failed, a FAILED file saying why, so a
later `--report-only` reads the same verdict back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from perf import ROOT


@dataclass
class ScheduleRun:
    """One schedule's run: its metrics rows and whether it finished."""

    schedule: str
    run_dir: str
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl, in file order
    failed: str = ""  # why the run did not finish ("" if it did)
    wall_s: float | None = None  # the launch's wall time (None: read back, not run here)


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSONL file ([] when there is none); a damaged line raises ValueError."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_run(schedule: str, run_dir: str) -> ScheduleRun:
    """What a run directory holds: metrics.jsonl's rows and the FAILED verdict."""
    failed = ""
    if os.path.exists(os.path.join(run_dir, "FAILED")):
        with open(os.path.join(run_dir, "FAILED")) as f:
            failed = f.read().strip() or "failed"
    return ScheduleRun(schedule, run_dir, read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
                       failed)


def env() -> dict[str, str]:
    """This checkout first on the runs' import path (their ranks and rollout included)."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + path if path else ""))


def launch(schedule: str, config: str, sets: list[str], run_dir: str,
           log: str | None = None, echo: str = "") -> ScheduleRun:
    """Run `schedule` through launch/run.py into a fresh `run_dir` (`sets`: its --set list,
    which names that run.dir) and read it back. The launcher's output goes to this
    process's, or with `log` is kept there too and shown with `echo` before each line. A
    run that stopped early leaves its updates so far and a FAILED file; an interrupted one
    (exit 130) raises KeyboardInterrupt."""
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics and eval files are appended to
    cmd = [sys.executable, os.path.join(ROOT, "launch", "run.py"), "--config", os.path.abspath(config)]
    if sets:
        cmd += ["--set", *sets]
    t0 = time.perf_counter()
    if log is None:
        rc = subprocess.run(cmd, cwd=ROOT, env=env(), check=False).returncode
    else:
        os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:  # the launcher's update lines, kept and shown
                out.write(line)
                print(f"{echo}{line}", end="", flush=True)
            rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc == 130:
        raise KeyboardInterrupt
    if rc != 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "FAILED"), "w") as f:
            f.write(f"launch/run.py exit {rc}, see {log or os.path.join(run_dir, 'logs')}\n")
    run = read_run(schedule, run_dir)
    run.wall_s = wall
    return run

