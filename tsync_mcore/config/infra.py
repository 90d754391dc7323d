"""Where a run lives and how its processes meet: the `run` (directory, length, loggers,
evaluation), `publish` (θ to the rollout), `channel` (the readiness channel) and `launch`
(GPUs, CPUs and nodes) sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tsync_mcore.config.checks import check, gpu_list, loopback, resolvable
from tsync_mcore.util import cpus


@dataclass
class RunConfig:
    """The run directory and its length."""

    dir: str = "runs/default"  # config.yaml, metrics.jsonl, traces, checkpoints
    updates: int = 10  # optimizer steps (one per batch) the run ends after
    save_every: int = 0  # checkpoint every N updates (0: only at the end)
    # Python GC: automatic collection off, one pass after publishing every N updates
    # (0: Python's automatic GC, whose full passes stalled the learner mid-stream)
    gc_every: int = 1
    # Where each update's metrics go (tsync_mcore.observability.tracking): console, jsonl (metrics.jsonl,
    # which report/predict read), tensorboard, wandb (offline unless WANDB_API_KEY is set),
    # mlflow (a file store under run.dir unless MLFLOW_TRACKING_URI is set)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project: str = ""  # W&B project / MLflow experiment; "": tsync-mcore
    name: str = ""  # W&B / MLflow run name; "": the last part of run.dir
    # At the end of training rank 0 exports the final checkpoint as a Hugging Face
    # directory to <run.dir>/hf (as `python -m tsync_mcore.learner.export`; docs/guide/export.md)
    export_hf: bool = True
    # Evaluate θ_k on data.eval every N updates (after its publication is acknowledged,
    # before the next batch: outside the step time); 0: no evaluation.
    eval_every: int = 0
    # Also evaluate θ_0 before the first batch (a fresh run only; before the learner's first
    # publication is acknowledged, so in no step time): the start of a learning curve
    eval_first: bool = False
    # Wall-clock budget: the learner stops after the first update that ends past this many
    # seconds of training (counted from the rollout's first acknowledgement of this
    # process; a resume starts a new budget), then checkpoints, exports and ends the run as
    # after run.updates; 0: off (run.updates only)
    budget_s: float = 0.0
    # Each learner rank (TP rank 0) appends every GRPO trajectory it receives to
    # <run.dir>/sources/rank<r>.jsonl, a replay file (its `update` on each line): what the
    # run trained can be replayed (python -m tsync_mcore.learner.replay) and audited
    save_sources: bool = False

    @property
    def evaluating(self) -> str:
        """The key that asks for evaluation, as messages name it ("" when none does)."""
        if self.eval_every:
            return f"run.eval_every={self.eval_every}"
        return "run.eval_first" if self.eval_first else ""

    def validate(self) -> None:
        check(self.updates >= 1, "run.updates", f"must be >= 1, got {self.updates}")
        check(self.budget_s >= 0, "run.budget_s", f"must be >= 0 (0: off), got {self.budget_s}")
        check(self.eval_every >= 0, "run.eval_every", f"must be >= 0, got {self.eval_every}")
        check(self.save_every >= 0, "run.save_every", "must be >= 0")
        check(self.gc_every >= 0, "run.gc_every", f"must be >= 0, got {self.gc_every}")
        check(bool(self.dir), "run.dir", "must not be empty")
        from tsync_mcore.observability.tracking import check_loggers  # the tracking module names the backends
        why = check_loggers(self.loggers)
        check(why is None, "run.loggers", why or "")


@dataclass
class PublishConfig:
    """How θ_{k+1} reaches the rollout (docs/design/publication.md); formerly run.publish_*."""

    # How θ_{k+1} reaches the rollout: dist: broadcast over a torch.distributed group (gloo
    # on CPU, NCCL on GPU) from learner rank 0 straight into every vLLM worker; file: a
    # safetensors file in publish.dir that each reloads
    method: Literal["dist", "file"] = "dist"
    # Where θ_{k+1} is written for the replicas; "" (default): a private per-run directory
    # in /dev/shm derived from the absolute run.dir (publication.send.resolve_dir).
    dir: str = ""
    bucket_mb: float = 64.0  # dist: broadcast θ in buckets of at most this size
    # dist: send only the elements that changed since the last publication (whole buckets
    # where more than publish.delta_dense of them changed); costs one HF-named copy of
    # θ in host memory on learner rank 0 and on every rollout worker; acks carry checksums
    delta: bool = False
    delta_dense: float = 0.25  # delta: changed fraction above which a bucket goes whole
    # dist: TCP port of the group's rendezvous store, served by the rollout at
    # channel.addr; 0: a free port, announced to learner rank 0 over the channel
    port: int = 0
    # dist: network interface the group's connections use (GLOO_SOCKET_IFNAME /
    # NCCL_SOCKET_IFNAME); "": the default route's
    ifname: str = ""
    # With model.lora (docs/guide/lora.md, "Publication"): merged: θ = W + (α/r)·B·A in the
    # served dtype, as for full runs; adapter: the adapter alone, a PEFT directory in
    # publish.dir that vLLM serves as a LoRA request over the base it started from
    # (needs publish.method: file)
    lora: Literal["merged", "adapter"] = "merged"

    def validate(self) -> None:
        check(self.method in ("dist", "file"), "publish.method",
              f"must be dist or file, got {self.method!r}")
        check(0 < self.bucket_mb <= 16384, "publish.bucket_mb",
              f"must be in (0, 16384], got {self.bucket_mb}")
        check(0.0 <= self.delta_dense <= 1.0, "publish.delta_dense",
              f"must be in [0, 1], got {self.delta_dense}")
        check(not self.delta or self.method == "dist", "publish.delta",
              "needs publish.method: dist")
        check(self.lora == "merged" or self.method == "file", "publish.lora",
              "'adapter' publishes a PEFT directory in publish.dir that each replica "
              "loads: set publish.method: file")
        check(0 <= self.port < 65536, "publish.port",
              f"must be a TCP port or 0 (a free one), got {self.port}")


@dataclass
class ChannelConfig:
    """The readiness channel: the rollout listens, each learner rank connects."""

    # The rollout host's address as the learners reach it (they connect here; the rollout
    # listens here too unless listen_addr says otherwise). Multi-node: a routable address.
    addr: str = "127.0.0.1"
    # Address the rollout binds the channel to, when it differs from the one learners dial
    # (NAT, a container's port mapping, or 0.0.0.0 for every interface); "": channel.addr
    listen_addr: str = ""
    # TCP port of that listener (not torchrun's); launch/run.py and make demo pick a free one
    port: int = 29610
    timeout_s: float = 300.0  # a learner waiting longer for a source stops with an error
    # How long the rollout waits for every learner rank to join, a learner for the
    # rollout's listener, and the learners for the first acknowledgement (the engines'
    # start) when hosts start one by one; 0: channel.timeout_s
    join_timeout_s: float = 0.0
    ack_timeout_s: float = 120.0  # publication must be acknowledged within this
    # The channel's reader threads under SCHED_FIFO (Linux, CAP_SYS_NICE): for hosts where
    # the learner shares cores with the rollout, like the CPU overlap benchmark.
    realtime_io: bool = False
    # The shared secret both sides prove at join and key the message MACs with; "" means
    # <run.dir>/channel.secret. Created by the first launcher (mode 0600) if missing.
    secret_file: str = ""

    def validate(self) -> None:
        check(0 < self.port < 65536, "channel.port", f"must be a TCP port, got {self.port}")
        check(resolvable(self.addr), "channel.addr",
              f"{self.addr!r} is neither an IP address nor a resolvable host name")
        check(not self.listen_addr or resolvable(self.listen_addr), "channel.listen_addr",
              f"{self.listen_addr!r} is neither an IP address nor a resolvable host name")
        check(self.timeout_s > 0, "channel.timeout_s", "must be > 0")
        check(self.join_timeout_s >= 0, "channel.join_timeout_s",
              f"must be >= 0 (0: channel.timeout_s), got {self.join_timeout_s}")
        check(self.ack_timeout_s > 0, "channel.ack_timeout_s", "must be > 0")


@dataclass
class LaunchConfig:
    """launch/run.py: which GPUs each side gets, and where the learner's nodes meet
    (docs/guide/multihost.md)."""

    # CUDA_VISIBLE_DEVICES of the learner ranks on each learner node, e.g. "0,1,2,3": one
    # GPU per rank, so rollout.n_learners / launch.nnodes of them ("": inherit the
    # environment's, e.g. on CPU)
    learner_gpus: str = ""
    # CUDA_VISIBLE_DEVICES of the rollout (replica i uses the i-th rollout.tp of them)
    rollout_gpus: str = ""
    # CPU cores of the learner ranks on each learner node, e.g. "1" or "4-7" (Linux CPU
    # list): every rank's threads are pinned to them and share them (torch threads per rank:
    # cores / ranks on the node). With launch.rollout_cpus on the same host, the CPU
    # analogue of separate rollout and learner GPUs. "": the cores this process may use.
    learner_cpus: str = ""
    # CPU cores of the rollout (vLLM's engine and threads, the agents, the channel), e.g.
    # "0"; must not overlap launch.learner_cpus when both sides run on one host
    rollout_cpus: str = ""
    # Learner nodes (torchrun --nnodes): rollout.n_learners ranks split evenly over them,
    # model.tp ranks of a tensor-parallel group always on one node; data parallelism
    # crosses nodes. Each node runs `launch/run.py --role learner --node-rank I`.
    nnodes: int = 1
    # torchrun's rendezvous: learner node 0's address as every learner node reaches it
    # (multi-node: a routable address, not loopback)
    master_addr: str = "127.0.0.1"
    # torchrun's rendezvous port on learner node 0; 0: a free port (one node only: every
    # node must be told the same port)
    master_port: int = 0
    # Network interface the learner's torch.distributed sockets use (GLOO_SOCKET_IFNAME,
    # NCCL_SOCKET_IFNAME), e.g. "eth1"; "": the library's choice (the interface of the
    # host name's address for gloo)
    ifname: str = ""
    # The learner's torch.distributed timeout: rendezvous, and every collective (gradient
    # reduce, checkpoint barriers). A learner peer that is gone or unreachable ends the run
    # with an error after this long instead of gloo's/NCCL's 30-minute default.
    dist_timeout_s: float = 600.0

    def validate(self) -> None:
        for key in ("learner_gpus", "rollout_gpus"):
            check(gpu_list(getattr(self, key)) is not None, f"launch.{key}",
                  f"must be comma-separated GPU indices like '0,1', got "
                  f"{getattr(self, key)!r}")
        for key in ("learner_cpus", "rollout_cpus"):
            check(cpus.parse(getattr(self, key)) is not None, f"launch.{key}",
                  f"must be a CPU list like '0-3,8', got {getattr(self, key)!r}")
        check(self.nnodes >= 1, "launch.nnodes", f"must be >= 1, got {self.nnodes}")
        check(0 <= self.master_port < 65536, "launch.master_port",
              f"must be a TCP port (0: a free one), got {self.master_port}")
        check(self.nnodes == 1 or self.master_port > 0, "launch.master_port",
              f"must be set for launch.nnodes = {self.nnodes}: every learner node has to be "
              f"told the same rendezvous port (0 picks a free port on one node only)")
        check(resolvable(self.master_addr), "launch.master_addr",
              f"{self.master_addr!r} is neither an IP address nor a resolvable host name")
        check(self.nnodes == 1 or not loopback(self.master_addr), "launch.master_addr",
              f"{self.master_addr!r} is a loopback address; with launch.nnodes = "
              f"{self.nnodes} it must be learner node 0's address that every node reaches")
        check(self.ifname == "" or (len(self.ifname) < 16 and "/" not in self.ifname
                                    and self.ifname.strip() == self.ifname),
              "launch.ifname", f"{self.ifname!r} is not a network interface name")
        check(self.dist_timeout_s > 0, "launch.dist_timeout_s",
              f"must be > 0, got {self.dist_timeout_s}")
