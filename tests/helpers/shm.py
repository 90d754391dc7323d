"""Checkpoint copies under /dev/shm, where the learner publishes θ (test_rollout,
test_replicas)."""

from __future__ import annotations

import os
import shutil
import uuid


def shm_copies(dirs, tag: str):
    """Each checkpoint's safetensors under /dev/shm, as the learner would publish them;
    a generator for a fixture (`yield from`): the copies go afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(os.path.dirname(dirs[0]))
    paths = []
    for i, d in enumerate(dirs):
        p = os.path.join(base, f"tsync_{tag}_{uuid.uuid4().hex[:8]}_{i}.safetensors")
        shutil.copy(os.path.join(d, "model.safetensors"), p)
        paths.append(p)
    try:
        yield paths
    finally:
        for p in paths:
            os.remove(p)
