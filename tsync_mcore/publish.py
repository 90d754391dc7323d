"""Publication of θ_{k+1}: export HF-named weights where every replica can load them.

On CPU (and single-node GPU runs) the weights go to a safetensors file in shared memory
(/dev/shm), which the rollout's vLLM worker extension reloads layer by layer. On multi-node
GPU deployments a bucketed NCCL broadcast would replace the file; the acknowledgement
protocol around it stays the same.

Whoever can write the publication directory decides what the replicas load, so it must be
private: owned by this user, not writable by group or others, not a symlink. By default
each run gets its own, derived from the absolute run directory (`resolve_dir`), so the
learner and the rollout find the same one from the same config.
"""

from __future__ import annotations

import glob
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterable

from safetensors.torch import save_file

from tsync_mcore.channel import Publish
from tsync_mcore.safe_files import BadFile


class PublishDirError(BadFile):
    """The publication directory is not private to this user; the message says why."""


def resolve_dir(run) -> str:
    """The publication directory of a run (RunConfig): `run.publish_dir`, or when that is
    empty a per-user, per-run directory in shared memory (the temp dir without /dev/shm)."""
    if run.publish_dir:
        return os.path.abspath(run.publish_dir)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    tag = hashlib.sha256(os.path.abspath(run.dir).encode()).hexdigest()[:16]
    return os.path.join(base, f"tsync-{os.getuid()}-{tag}")


def ensure_private_dir(path: str) -> str:
    """Create `path` 0700 if absent; refuse it unless it is a real directory owned by this
    user and not writable by group or others. Returns `path`."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    except FileExistsError:
        pass  # checked below, like any directory found in place
    check_private_dir(path)
    return path


def check_private_dir(path: str) -> None:
    try:
        st = os.lstat(path)
    except OSError as e:
        raise PublishDirError(f"publish directory {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise PublishDirError(f"publish directory {path}: is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise PublishDirError(f"publish directory {path}: not a directory")
    if st.st_uid != os.geteuid():
        raise PublishDirError(f"publish directory {path}: owned by uid {st.st_uid}, not by "
                              f"this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise PublishDirError(f"publish directory {path}: writable by group or others "
                              f"(mode {stat.S_IMODE(st.st_mode):o})")


def path_for(publish_dir: str, version: int) -> str:
    return os.path.join(publish_dir, f"policy_v{version}.safetensors")


def write(policy, publish_dir: str, version: int) -> str:
    """Collective at TP > 1 (the export gathers TP shards); rank 0 writes the file."""
    path = path_for(publish_dir, version)
    if policy.par.tp_size == 1 and policy.par.rank != 0:
        return path
    params = policy.export_params()
    if policy.par.rank == 0:
        ensure_private_dir(publish_dir)  # again: it may have been removed or swapped
        tmp = path + ".tmp"
        save_file({k: v.contiguous() for k, v in params.items()}, tmp)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)  # a replica never sees a half-written file
    return path


def notice(version: int, path: str) -> Publish:
    return Publish(version=version, path=path)


def cleanup(publish_dir: str, keep: int | Iterable[int]) -> None:
    """Drop every file but those of `keep`: the version every replica acknowledged last
    and, under the asynchronous schedules, every version published but not yet
    acknowledged (a replica may still be loading it)."""
    keep = {keep} if isinstance(keep, int) else set(keep)
    kept = {path_for(publish_dir, v) for v in keep}
    for p in glob.glob(os.path.join(publish_dir, "policy_v*.safetensors")):
        if p not in kept:
            os.remove(p)
