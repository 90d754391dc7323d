"""One rank of a 2-rank gloo job that checks run.dir is shared (checkpoint.check_shared_run_dir).

Usage: shared_dir_worker.py RUN_DIR (env: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE). Prints `OK` or `REFUSED <message>`.
"""

import sys
from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist

from tsync_mcore.channel import nodes
from tsync_mcore.learner import checkpoint


def main(run_dir: str) -> str:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    par = SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size())
    try:
        checkpoint.check_shared_run_dir(run_dir, par, "cpu", nodes.rank_label(par.rank))
        return "OK"
    except checkpoint.CheckpointError as e:
        return f"REFUSED {e}"
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(main(sys.argv[1]), flush=True)
