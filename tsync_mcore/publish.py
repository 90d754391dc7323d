"""Publication of θ_{k+1}: export HF-named weights where every replica can load them.

On CPU (and single-node GPU runs) the weights go to a safetensors file in shared memory
(/dev/shm), which the rollout's vLLM worker extension reloads layer by layer. On multi-node
GPU deployments a bucketed NCCL broadcast would replace the file; the acknowledgement
protocol around it stays the same.
"""

from __future__ import annotations

import glob
import os

from safetensors.torch import save_file

from tsync_mcore.channel import Publish


def path_for(publish_dir: str, version: int) -> str:
    return os.path.join(publish_dir, f"policy_v{version}.safetensors")


def write(policy, publish_dir: str, version: int) -> str:
    """Collective at TP > 1 (the export gathers TP shards); rank 0 writes the file."""
    path = path_for(publish_dir, version)
    if policy.par.tp_size == 1 and policy.par.rank != 0:
        return path
    params = policy.export_params()
    if policy.par.rank == 0:
        os.makedirs(publish_dir, exist_ok=True)
        tmp = path + ".tmp"
        save_file({k: v.contiguous() for k, v in params.items()}, tmp)
        os.replace(tmp, path)  # a replica never sees a half-written file
    return path


def notice(version: int, path: str) -> Publish:
    return Publish(version=version, path=path)


def cleanup(publish_dir: str, keep: int) -> None:
    """Drop files of older versions once every replica acknowledged `keep`."""
    for p in glob.glob(os.path.join(publish_dir, "policy_v*.safetensors")):
        if p != path_for(publish_dir, keep):
            os.remove(p)
