"""Typed configuration, loaded from configs/*.yaml and validated at start.

Every section is a dataclass. `load_config` walks the YAML mapping against the dataclass
fields, so a misspelt key or a value of the wrong type or outside its allowed set fails
immediately with a message naming the dotted key (e.g. `learner.k_open`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import socket
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

Schedule = Literal["sync", "group_ready", "thundersync"]
DType = Literal["fp32", "bf16"]
TokenNorm = Literal["auto", "trajectory", "global"]
AccumPlacement = Literal["device", "host"]
AccumDType = Literal["fp32", "fp64"]


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the dotted key."""


@dataclass
class ModelConfig:
    hf_dir: str = ""  # Hugging Face checkpoint directory (Qwen2/Qwen3/Llama)
    dtype: DType = "fp32"  # student forward/backward precision; grads accumulate in FP32
    tp: int = 1  # tensor-parallel size; data-parallel size = world size / tp
    spec: Literal["auto", "local", "te"] = "auto"  # TE layer spec on GPU, local spec on CPU
    # local spec's core attention: SDPA kernels (auto: on GPU) or megatron's DotProductAttention
    attention: Literal["auto", "sdpa", "megatron"] = "auto"

    def validate(self) -> None:
        _check(self.tp >= 1, "model.tp", f"must be >= 1, got {self.tp}")


@dataclass
class OptimConfig:
    # AdamW β 0.9/0.999, ε 1e-8, wd 0, lr 1e-6 constant, global-norm clip 1.0 (the paper's).
    lr: float = 1e-6
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    distributed: bool = True  # shard optimizer state across data-parallel ranks

    def validate(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(0 <= self.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {self.beta1}")
        _check(0 <= self.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {self.beta2}")
        _check(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(self.clip_grad >= 0, "optim.clip_grad", "must be >= 0 (0 disables clipping)")


@dataclass
class LearnerConfig:
    objective: str = "grpo"  # a name in tsync_mcore.objectives.OBJECTIVES
    schedule: Schedule = "thundersync"
    k_open: int = 4  # admission cap: groups per rank holding G1/G2 at once
    accum: AccumPlacement = "device"  # "host": pinned host memory for large models
    # fp64 doubles accumulator memory (8(2k+1)P bytes) but makes the update independent of
    # arrival order to within FP32 rounding of the final sum (docs/numerics.md).
    accum_dtype: AccumDType = "fp32"
    # w = 1/(n_groups·L_i), or 1/N_k global token mean; auto: GRPO family "trajectory",
    # OPD "global" (a turn streams before its trajectory's length L_i is known)
    token_norm: TokenNorm = "auto"
    adv_eps: float = 1e-6  # ε in (r − μ)/(σ + ε)
    # OPD deferred replay: recompute earlier turns from their context leaves (linear FLOPs),
    # or retain each turn's graph until its trajectory completes (no recompute, more memory).
    opd_replay: Literal["recompute", "retain"] = "recompute"
    # GRPO groups share their prompt: run it once per group and backpropagate it once at
    # group close with the combined boundary adjoint (docs/design.md). Same update either way.
    shared_prefix: bool = True
    # Memory-aware admission: a new group opens only while what open groups hold (G1'/G2 or
    # gradient sums, K/V leaves + adjoints, shared prompts) plus its estimate fits; 0: off.
    max_open_bytes: int = 0
    # Longest source (a GRPO trajectory, an OPD turn's end) accepted; 0: the model's positions.
    max_tokens: int = 0
    # A non-finite reduced gradient never steps (θ and the optimizer stay as they were);
    # "stop" ends the run with the reason, "drop_batch" goes on with the next batch on θ_k.
    on_nonfinite: Literal["stop", "drop_batch"] = "stop"
    # "update": one check of the reduced gradient before the step; "source": also check the
    # sums after every source's service, so the report names the source that broke them
    # (one more pass over a gradient-sized vector per source).
    check_finite: Literal["update", "source"] = "update"

    def validate(self) -> None:
        from tsync_mcore.objectives import OBJECTIVES  # the objectives/ files define the names
        _check(self.objective in OBJECTIVES, "learner.objective",
               f"must be one of {sorted(OBJECTIVES)}, got {self.objective!r}")
        _check(self.k_open >= 1, "learner.k_open", f"must be >= 1, got {self.k_open}")
        _check(self.adv_eps > 0, "learner.adv_eps", f"must be > 0, got {self.adv_eps}")
        _check(self.max_open_bytes >= 0, "learner.max_open_bytes",
               f"must be >= 0 (0: no byte budget), got {self.max_open_bytes}")
        _check(self.max_tokens >= 0, "learner.max_tokens",
               f"must be >= 0 (0: the model's positions), got {self.max_tokens}")
        _check(not (self.objective == "opd" and self.token_norm == "trajectory"),
               "learner.token_norm", "'trajectory' needs each trajectory's scored length "
               "before its first source trains; OPD streams turns, use 'global'")
        if self.token_norm == "auto":  # resolved here, once: what runs is what config.yaml says
            self.token_norm = "global" if self.objective == "opd" else "trajectory"


@dataclass
class RunConfig:
    dir: str = "runs/default"  # config.yaml, metrics.jsonl, traces, checkpoints
    updates: int = 10
    save_every: int = 0  # checkpoint every N updates (0: only at the end)
    # Where θ_{k+1} is written for the replicas; "" (default): a private per-run directory
    # in /dev/shm derived from the absolute run.dir (publish.resolve_dir).
    publish_dir: str = ""
    # Python GC: automatic collection off, one pass after publishing every N updates
    # (0: Python's automatic GC, whose full passes stalled the learner mid-stream)
    gc_every: int = 1

    def validate(self) -> None:
        _check(self.updates >= 1, "run.updates", f"must be >= 1, got {self.updates}")
        _check(self.save_every >= 0, "run.save_every", "must be >= 0")
        _check(self.gc_every >= 0, "run.gc_every", f"must be >= 0, got {self.gc_every}")
        _check(bool(self.dir), "run.dir", "must not be empty")


@dataclass
class ChannelConfig:
    addr: str = "127.0.0.1"
    port: int = 29610
    timeout_s: float = 300.0  # a learner waiting longer for a source stops with an error
    ack_timeout_s: float = 120.0  # publication must be acknowledged within this
    # The channel's reader threads under SCHED_FIFO (Linux, CAP_SYS_NICE): for hosts where
    # the learner shares cores with the rollout, like the CPU overlap benchmark.
    realtime_io: bool = False
    # The shared secret both sides prove at join and key the message MACs with; "" means
    # <run.dir>/channel.secret. Created by the first launcher (mode 0600) if missing.
    secret_file: str = ""

    def validate(self) -> None:
        _check(0 < self.port < 65536, "channel.port", f"must be a TCP port, got {self.port}")
        _check(_resolvable(self.addr), "channel.addr",
               f"{self.addr!r} is neither an IP address nor a resolvable host name")
        _check(self.timeout_s > 0, "channel.timeout_s", "must be > 0")
        _check(self.ack_timeout_s > 0, "channel.ack_timeout_s", "must be > 0")


@dataclass
class RolloutConfig:
    n_learners: int = 2  # learner ranks (world size of the learner torchrun)
    env: str = "toy"  # "toy" or "skyrl:<env name>"
    groups_per_batch: int = 8
    group_size: int = 4
    max_turns: int = 3
    max_tokens_per_turn: int = 8
    max_total_tokens: int = 96
    temperature: float = 1.0
    tool_latency_s: float = 0.05  # median of the long-tailed (log-normal) tool latency
    tool_timeout_s: float = 1.0
    teacher_dir: str = ""  # OPD: the frozen teacher's HF directory
    kv_cache_gib: float = 1.0
    # Which learner rank serves a finished trajectory (tsync_mcore.routing). auto: GRPO
    # family "balanced" (per trajectory, least-loaded rank), OPD "static" (by group).
    routing: Literal["auto", "static", "balanced"] = "auto"

    def validate(self) -> None:
        _check(self.n_learners >= 1, "rollout.n_learners", "must be >= 1")
        _check(self.groups_per_batch >= 1, "rollout.groups_per_batch", "must be >= 1")
        _check(self.group_size >= 1, "rollout.group_size", "must be >= 1")
        _check(self.max_turns >= 1, "rollout.max_turns", "must be >= 1")
        _check(self.max_tokens_per_turn >= 1, "rollout.max_tokens_per_turn", "must be >= 1")
        _check(self.env == "toy" or self.env.startswith("skyrl:"), "rollout.env",
               f"must be 'toy' or 'skyrl:<name>', got {self.env!r}")
        _check(self.max_total_tokens >= 1, "rollout.max_total_tokens", "must be >= 1")
        _check(self.temperature >= 0, "rollout.temperature",
               f"must be >= 0 (0: greedy), got {self.temperature}")
        _check(self.tool_latency_s >= 0, "rollout.tool_latency_s", "must be >= 0")
        _check(self.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0")
        _check(self.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int = 1234

    def validate(self) -> None:
        self.model.validate()
        self.optim.validate()
        self.learner.validate()
        self.run.validate()
        self.channel.validate()
        self.rollout.validate()
        _check(self.rollout.n_learners % self.model.tp == 0, "rollout.n_learners",
               f"{self.rollout.n_learners} learner ranks do not split into tensor-parallel "
               f"groups of model.tp = {self.model.tp}")
        _check(not (self.learner.objective == "opd" and self.rollout.routing == "balanced"),
               "rollout.routing", "'balanced' is for the GRPO family; OPD routes by group "
               "(a trajectory's turns and its group's shared prompt stay on one rank)")

    @property
    def routing(self) -> str:
        """rollout.routing with 'auto' resolved for the objective."""
        if self.rollout.routing != "auto":
            return self.rollout.routing
        return "static" if self.learner.objective == "opd" else "balanced"


def _resolvable(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        pass
    try:
        socket.getaddrinfo(addr, None)
        return True
    except (OSError, UnicodeError):
        return False


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {why}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotated type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        _check(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if tp is bool:
        _check(isinstance(value, bool), key, f"must be true/false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key,
               f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok, key, f"must be a number, got {value!r}")
        # inf/nan would pass every range check below and then poison the update
        _check(math.isfinite(float(value)), key, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    raise ConfigError(f"config key '{key}': unsupported type {tp}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, naming the dotted key of any error."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"config key '{where}': must be a mapping of its keys, got "
                          f"{type(data).__name__} {str(data)[:80]!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{prefix}{key}"
            raise ConfigError(f"config key '{where}': unknown key (allowed: {sorted(names)})")
    kwargs = {}
    for name, value in data.items():
        tp, key = hints[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(value, tp, key)
    return cls(**kwargs)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` command-line overrides; each VALUE is read as YAML (`4`, `true`, `1e-6`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: must be KEY=VALUE with a dotted key, e.g. "
                              f"learner.k_open=2")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not YAML "
                              f"({str(e).splitlines()[0]})") from None
    return out


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {path}{at}: not valid YAML ({why})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of sections (model:, "
                          f"learner:, ...), got a YAML {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load a YAML file (or defaults) and apply dotted overrides like {"learner.k_open": 2}."""
    data: dict[str, Any] = _read_yaml(path) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                where = ".".join(parents[:i + 1])
                raise ConfigError(f"config key '{where}': a section, cannot hold "
                                  f"'{dotted}' (it was set to {node!r})")
        node[leaf] = value
    cfg = from_dict(Config, data)
    cfg.validate()
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
