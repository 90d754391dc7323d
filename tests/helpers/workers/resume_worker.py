"""Resume exactness: N updates straight vs k updates, checkpoint, fresh process, N − k more.

Usage: resume_worker.py HF_DIR BATCH RUN_DIR MODE[,MODE...]
(MODE: straight | first | resume | corrupt | refused; several run one after the other in this
process, each with its own Policy: `straight,first` saves a launch, a resume needs a fresh
process, `resume,corrupt,refused` another.)
Prints one RESULT per rank: the modes' results in order (one mode: its result alone). Rank 0
writes each mode's final parameters; `corrupt`: rank 0 overwrites the last 8 bytes of rank 1's
file in the latest checkpoint; `refused` expects the resume to fail on every rank and
reports each rank's error instead.
"""

import os
import sys

import torch
from safetensors.torch import save_file

from tests.helpers.dist_util import emit  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan
from tsync_mcore.config import load_config
from tsync_mcore.learner import checkpoint
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.replay import read_batches
from tsync_mcore.learner.update import Learner


def main(hf_dir: str, batch: str, run_dir: str, mode: str, split: int = 2) -> dict:
    if mode == "corrupt":  # after the modes before it: the process group is up
        import torch.distributed as dist
        if dist.get_rank() == 0:
            with open(os.path.join(checkpoint.latest(run_dir), "rank1.safetensors"), "r+b") as f:
                f.seek(-8, os.SEEK_END)
                f.write(b"\xff" * 8)
        dist.barrier()
        return {"rank": dist.get_rank()}
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-4, "learner.k_open": 2})
    policy = Policy(cfg)
    batches = read_batches(batch)
    start = 0
    if mode == "refused":
        before = policy.export_params()
        try:
            checkpoint.load(checkpoint.latest(run_dir), policy)
            error = None
        except checkpoint.CheckpointError as e:
            error = str(e)
        after = policy.export_params()
        same = all(torch.equal(before[k], after[k]) for k in before)
        return {"rank": policy.par.rank, "error": error, "unchanged": same}
    if mode == "resume":
        meta = checkpoint.load(checkpoint.latest(run_dir), policy)
        start = meta["data_pos"]
    learner = Learner(cfg.learner, policy, policy_version=start)
    stop = split if mode == "first" else len(batches)
    for sources in batches[start:stop]:
        learner.begin(BatchPlan.from_sources(sources))
        for s in sources:
            learner.submit(s)
        learner.close()
    if mode == "first":
        checkpoint.save(run_dir, policy, version=learner.version, data_pos=stop)
    params = policy.export_params()
    if policy.par.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        save_file({k: v.contiguous() for k, v in params.items()},
                  os.path.join(run_dir, f"params_{mode}.safetensors"))
    return {"version": learner.version, "rank": policy.par.rank}


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    results = [main(*sys.argv[1:4], mode) for mode in sys.argv[4].split(",")]
    out = results[0] if len(results) == 1 else {"rank": results[0]["rank"], "modes": results}
    emit(out)
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
