"""Publication of θ_{k+1}, the learner's side: export HF-named weights where every replica
can load them (docs/design/publication.md).

publish.method: file writes them to a safetensors file in the publication directory
(shared memory, /dev/shm, by default), which the rollout's vLLM worker extension reloads
layer by layer; with publish.lora: adapter, a PEFT adapter directory there instead.
publish.method: dist (the default) hands them to tsync_mcore.publication.dist, which broadcasts them in
buckets (optionally as deltas) over a gloo/NCCL group straight into the vLLM workers. Either
way `Publisher` announces a `Publish` on the channel, and the acknowledgement protocol
around it (tsync_mcore.publication.receive on the rollout) is the same.

Whoever can write the publication directory decides what the replicas load, so it must be
private: owned by this user, not writable by group or others, not a symlink. By default
each run gets its own, derived from the absolute run directory (`resolve_dir`), so the
learner and the rollout find the same one from the same config.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable

from safetensors.torch import save_file

from tsync_mcore.channel import Publish
from tsync_mcore.util.safe_files import BadFile


class PublishDirError(BadFile):
    """The publication directory is not private to this user; the message says why."""


def resolve_dir(pub, run_dir: str) -> str:
    """The publication directory of a run: `publish.dir` (`pub`, a PublishConfig), or when
    that is empty a per-user directory in shared memory (the temp dir without /dev/shm) for
    the run directory `run_dir` (run.dir)."""
    if pub.dir:
        return os.path.abspath(pub.dir)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    tag = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
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
    """Collective at TP or EP > 1 (the export gathers TP shards and experts); rank 0
    writes the file."""
    path = path_for(publish_dir, version)
    if not policy.gathers_to_export and policy.par.rank != 0:
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


# --------------------------------------------------------------------------- LoRA adapters


def method_of(pub) -> str:
    """What a Publish of this run (`pub`, a PublishConfig) says: file, dist, or adapter (a
    PEFT directory, publish.lora: adapter; the config check makes that publish.method:
    file)."""
    return "adapter" if pub.lora == "adapter" else pub.method


def adapter_path_for(publish_dir: str, version: int) -> str:
    return os.path.join(publish_dir, f"policy_v{version}.adapter")


def write_adapter(policy, publish_dir: str, version: int) -> str:
    """publish.lora: adapter. Collective at TP > 1 (`Policy.export_adapter` gathers
    the TP shards); rank 0 writes θ_version's adapter as a PEFT directory (adapter_config
    + adapter_model.safetensors), built beside it and renamed into place, so a replica
    never sees half of one."""
    from tsync_mcore.model import lora

    path = adapter_path_for(publish_dir, version)
    if not policy.gathers_to_export and policy.par.rank != 0:
        return path
    tensors = policy.export_adapter()
    if policy.par.rank == 0:
        ensure_private_dir(publish_dir)
        tmp = path + ".tmp"
        for old in (tmp, path):  # a run before a resume may have left them
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old)
            elif os.path.lexists(old):
                os.remove(old)
        lora.write_peft_dir(tmp, policy.lora, tensors, base_model=policy.cfg.model.hf_dir)
        os.replace(tmp, path)
    return path


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def cleanup(publish_dir: str, keep: int | Iterable[int]) -> None:
    """Drop every file (and adapter directory) but those of `keep`: the version every
    replica acknowledged last and, under the asynchronous schedules, every version
    published but not yet acknowledged (a replica may still be loading it)."""
    keep = {keep} if isinstance(keep, int) else set(keep)
    kept = {path_for(publish_dir, v) for v in keep}
    kept |= {adapter_path_for(publish_dir, v) for v in keep}
    for p in glob.glob(os.path.join(publish_dir, "policy_v*.safetensors")):
        if p not in kept:
            os.remove(p)
    for p in glob.glob(os.path.join(publish_dir, "policy_v*.adapter")):
        if p not in kept and os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)


# --------------------------------------------------------------------------- both methods


class Publisher:
    """The learner's side of publication (publish.method), for every rank: `publish` is a
    collective (the export gathers TP shards); rank 0 sends the notice and, for dist,
    broadcasts θ over the publication group (tsync_mcore.publication.dist), which it joins at
    the first publication. `stats` holds the last publication's metrics."""

    def __init__(self, pub, channel, policy, link, publish_dir: str,
                 rollout_dtype: str = "", secret: bytes | None = None) -> None:
        self.pub, self.channel, self.policy = pub, channel, policy  # pub: PublishConfig
        self.secret = secret  # the run's channel secret: dist members prove they hold it
        # dist: θ travels in the rollout's precision (rollout.dtype), which vLLM would cast
        # to anyway: an fp32 learner feeding a bf16 rollout sends half the bytes, and bf16
        # deltas stay sparse
        import torch

        self.cast = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(rollout_dtype)
        self.link = link  # rank 0's; None elsewhere
        self.publish_dir = publish_dir
        self.rank0 = policy.par.rank == 0
        self.sender = None  # publish_dist.Sender, rank 0, dist
        self.params = None  # the header's params (dist; every rank learns them once)
        self.checksums: dict[int, str] = {}  # delta: version → checksum of what was sent
        self.full_resends = 0
        self.stats: dict = {}

    def publish(self, version: int) -> None:
        if self.pub.lora == "adapter":
            path = write_adapter(self.policy, self.publish_dir, version)
            if self.rank0:
                self.link.send(Publish(version=version, path=path, method="adapter"))
                self.stats = {"publish/method": "adapter", "publish/bytes": _tree_bytes(path)}
            return
        if self.pub.method == "file":
            path = write(self.policy, self.publish_dir, version)
            if self.rank0:
                self.link.send(notice(version, path))
                self.stats = {"publish/method": "file", "publish/bytes": os.path.getsize(path)}
            return
        if not self.policy.gathers_to_export and not self.rank0:
            return
        from tsync_mcore.publication import dist as publish_dist

        if self.params is None:  # names, shapes, dtypes: one pass at the start
            self.params = publish_dist.params_of(self._named())
        named = self._named()
        if not self.rank0:
            for _ in named:  # this rank's part of each TP / expert gather
                pass
            return
        if self.sender is None:
            self.sender = self._join()
        snd = self.sender
        full_due = snd.force_full and snd.base is not None
        self.link.send(Publish(version=version, path="", method="dist",
                               n_buckets=len(snd.buckets), delta=snd.delta))
        st = snd.publish(version, named)
        if snd.delta:
            self.checksums[version] = st.checksum
        self.full_resends += int(full_due)
        self.stats = {"publish/method": "dist+delta" if snd.delta else "dist",
                      "publish/bytes": st.bytes, "publish/buckets": st.buckets,
                      "publish/delta_share": st.changed / max(1, st.elements) if snd.delta
                      else None,
                      "publish/sparse_buckets": st.sparse_buckets,
                      "publish/full_resends": self.full_resends}

    def _named(self):
        cast = self.cast
        for name, t in self.policy.iter_params():
            yield name, (t.to(cast) if cast is not None and t.is_floating_point() else t)

    def kept_notice(self, version: int) -> Publish:
        """The notice of θ_version again (a dropped batch): nothing to load."""
        if self.pub.lora == "adapter":
            return Publish(version=version, path=adapter_path_for(self.publish_dir, version),
                           method="adapter")
        if self.pub.method == "file":
            return notice(version, path_for(self.publish_dir, version))
        return Publish(version=version, path="", method="dist", n_buckets=0,
                       delta=self.pub.delta)

    def check_ack(self, ack) -> str:
        """Rank 0, delta: the checksum every rollout worker reports for the version it
        acknowledged against the one sent. A mismatch (a replica drifted) makes the next
        publication whole; returns why ("" if it matched or there is nothing to check)."""
        want = self.checksums.pop(ack.version, None)
        for v in [v for v in self.checksums if v < ack.version]:
            del self.checksums[v]
        if want is None or self.sender is None:
            return ""
        got = ack.checksum.split(",") if ack.checksum else []
        if got and all(c == want for c in got):
            return ""
        self.sender.force_full = True
        return (f"rollout checksum of θ_{ack.version} {ack.checksum or '(none)'} differs from "
                f"the learner's {want}: the next publication is sent whole")

    def _join(self):
        from tsync_mcore.publication import dist as publish_dist
        from tsync_mcore.channel import PublishGroup

        ch, pub = self.channel, self.pub
        msg = self.link.recv(timeout_s=max(ch.ack_timeout_s, ch.timeout_s, ch.join_timeout_s))
        if not isinstance(msg, PublishGroup):
            raise publish_dist.PublishError(f"publish.method: dist: expected the rollout's "
                                            f"PublishGroup, got {type(msg).__name__} (does "
                                            f"the rollout run the same config?)")
        if not 0 < msg.port < 65536 or not 2 <= msg.world <= 4096:
            raise publish_dist.PublishError(f"rollout's PublishGroup: port {msg.port}, world "
                                            f"{msg.world} out of range")
        mine = "nccl" if self.policy.device.type == "cuda" else "gloo"
        if msg.backend != mine:
            raise publish_dist.PublishError(f"publication group: the rollout uses "
                                            f"{msg.backend}, this learner {mine}")
        key = publish_dist.group_key(self.secret, msg.token) if self.secret else None
        pg = publish_dist.join_group(ch.addr, msg.port, 0, msg.world, token=msg.token,
                                     timeout_s=ch.ack_timeout_s, backend=mine,
                                     ifname=pub.ifname, key=key)
        return publish_dist.Sender(pg, self.params, int(pub.bucket_mb * 2**20),
                                   backend=mine, delta=pub.delta,
                                   dense_frac=pub.delta_dense)
