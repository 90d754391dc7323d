"""The records a learner appends to its run directory, and what a new start does with them.

    RUN/metrics.jsonl          one row per update (rank 0)
    RUN/traces/rank{R}.jsonl   the learner's trace, per rank (docs/design/trace.md)
    RUN/nvml_rank{R}.jsonl     the NVML timeline, per rank (GPU only)
    RUN/eval.jsonl             evaluations (the rollout writes them; rank 0 owns the file)
    RUN/tensorboard/           TensorBoard event files (rank 0; a resume purges by step)

Every reader (predict, report, the benchmarks) takes a file's records as one run's, so a
second run appending to the first's files would mix two runs per update (the predictor then
sees each update's learner work twice). A fresh run therefore starts these files afresh; a
resumed run keeps the records up to its checkpoint's policy version and drops the ones of
updates after it: those were not checkpointed and are trained again.
"""

from __future__ import annotations

import glob
import json
import os
import re

_RANK = re.compile(r"rank(\d+)\.jsonl$")


def _rank_files(run_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "traces", "rank*.jsonl"))
                  + glob.glob(os.path.join(run_dir, "nvml_rank*.jsonl")))


def own_files(run_dir: str, rank: int) -> list[str]:
    """This rank's record files (rank 0 also owns metrics.jsonl)."""
    out = [os.path.join(run_dir, "traces", f"rank{rank}.jsonl"),
           os.path.join(run_dir, f"nvml_rank{rank}.jsonl")]
    if rank == 0:
        out += [os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "eval.jsonl"),
                *glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))]
    return out


def start_fresh(run_dir: str, rank: int) -> list[str]:
    """Remove the records an earlier run left (this rank's files; rank 0 also metrics.jsonl
    and every rank file, so files of ranks this run does not have go too). Returns the paths
    removed, relative to run_dir."""
    paths = set(own_files(run_dir, rank)) | (set(_rank_files(run_dir)) if rank == 0 else set())
    removed = []
    for p in sorted(paths):
        if os.path.isfile(p):
            os.remove(p)
            removed.append(os.path.relpath(p, run_dir))
    return removed


def keep_until(run_dir: str, rank: int, version: int, checkpoint_time: float) -> int:
    """A resume from the checkpoint of policy version `version`: keep this rank's records of
    updates before it and drop the rest. Trace records of update k (trained from θ_k) stay
    when k < version; metrics rows of a step to `version` stay (a skipped batch's row, whose
    step is the version it stayed at, when that is below `version`); NVML samples taken up
    to the checkpoint's write time stay. Returns the number of lines dropped."""
    def keep_trace(obj: dict) -> bool:
        return isinstance(obj.get("update"), int) and obj["update"] < version

    def keep_metrics(obj: dict) -> bool:
        step = obj.get("step")
        return isinstance(step, int) and (step <= version if obj.get("ok", True)
                                          else step < version)

    def keep_eval(obj: dict) -> bool:
        v = obj.get("eval/policy_version")
        return isinstance(v, int) and v <= version

    def keep_nvml(obj: dict) -> bool:
        t = obj.get("t_wall")
        return isinstance(t, (int, float)) and t <= checkpoint_time

    files = [(os.path.join(run_dir, "traces", f"rank{rank}.jsonl"), keep_trace),
             (os.path.join(run_dir, f"nvml_rank{rank}.jsonl"), keep_nvml)]
    if rank == 0:
        files.append((os.path.join(run_dir, "metrics.jsonl"), keep_metrics))
        files.append((os.path.join(run_dir, "eval.jsonl"), keep_eval))
    return sum(_filter_lines(path, keep) for path, keep in files)


def _filter_lines(path: str, keep) -> int:
    """Rewrite a JSONL file with the lines `keep` accepts (a damaged or partial line goes
    too); atomic: the old file stays whole until the new one replaces it."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                ok = line.endswith("\n") and keep(json.loads(line))
            except (json.JSONDecodeError, AttributeError):
                ok = False
            if ok:
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped
