"""The `optim` and `learner` sections: AdamW and its LR schedule; the streaming learner's
objective, release schedule, off-policy correction, regularizers, admission and
accumulators."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Literal

from tsync_mcore.config.checks import check


Schedule = Literal["sync", "group_ready", "thundersync", "one_step_off", "fully_async"]
TokenNorm = Literal["auto", "trajectory", "token_mean", "seq_mean_token_mean",
                    "seq_mean_token_sum_norm", "group_scaled_token_mean", "global"]
AccumPlacement = Literal["device", "host"]
AccumDType = Literal["fp32", "fp64"]


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
        check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        check(0 <= self.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {self.beta1}")
        check(0 <= self.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {self.beta2}")
        check(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        check(self.clip_grad >= 0, "optim.clip_grad", "must be >= 0 (0 disables clipping)")
        check(self.warmup_updates >= 0, "optim.warmup_updates",
              f"must be >= 0, got {self.warmup_updates}")
        check(self.decay_updates >= 0, "optim.decay_updates",
              f"must be >= 0 (0: run.updates), got {self.decay_updates}")
        check(self.min_lr >= 0, "optim.min_lr", f"must be >= 0, got {self.min_lr}")
        check(self.lr_schedule == "constant" or self.min_lr <= self.lr, "optim.min_lr",
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
        check(self.objective in OBJECTIVES, "learner.objective",
              f"must be one of {sorted(OBJECTIVES)}, got {self.objective!r}")
        check(self.k_open >= 1, "learner.k_open", f"must be >= 1, got {self.k_open}")
        check(self.adv_eps > 0, "learner.adv_eps", f"must be > 0, got {self.adv_eps}")
        check(self.max_open_bytes >= 0, "learner.max_open_bytes",
              f"must be >= 0 (0: no byte budget), got {self.max_open_bytes}")
        check(self.max_tokens >= 0, "learner.max_tokens",
              f"must be >= 0 (0: the model's positions), got {self.max_tokens}")
        check(self.max_tokens_per_pass >= 0, "learner.max_tokens_per_pass",
              f"must be >= 0 (0: one source per pass), got {self.max_tokens_per_pass}")
        check(self.max_staleness >= 1, "learner.max_staleness",
              f"must be >= 1, got {self.max_staleness}")
        check(self.is_cap >= 1, "learner.is_cap", f"must be >= 1, got {self.is_cap}")
        check(0 <= self.is_low <= 1, "learner.is_low", f"must be in [0, 1], got {self.is_low}")
        check(not (self.is_correction.startswith("seq_") and self.objective == "opd"),
              "learner.is_correction", f"'{self.is_correction}' weights a whole sequence by "
              f"its geometric-mean ratio, which needs all its scored tokens at once; OPD "
              f"trains each turn as it is scored (use tis or mis)")
        self._validate_regularizers()
        check(self.lm_head_chunk > 0, "learner.lm_head_chunk",
              f"must be > 0 (tokens per chunk of the fused LM head), got {self.lm_head_chunk}")
        check(self.schedule in ("sync", "group_ready", "thundersync")
              or self.on_nonfinite == "stop", "learner.on_nonfinite",
              f"'drop_batch' needs a synchronous schedule: under '{self.schedule}' the rollout "
              f"has already sampled later batches from the weights a dropped batch keeps")
        self._validate_token_norm(OBJECTIVES[self.objective])

    def _validate_regularizers(self) -> None:
        from tsync_mcore.objectives.regularizers import KL_ESTIMATORS, VERL_KL
        check(self.kl_estimator in VERL_KL, "learner.kl_estimator",
              f"must be one of {list(KL_ESTIMATORS)} (or verl's kl, mse, low_var_kl), got "
              f"{self.kl_estimator!r}")
        self.kl_estimator = VERL_KL[self.kl_estimator]
        for key in ("kl_coef", "entropy_coef"):
            v = getattr(self, key)
            check(math.isfinite(v) and v >= 0, f"learner.{key}",
                  f"must be a finite number >= 0 (0: off), got {v}")
        check(self.minibatches >= 1, "learner.minibatches",
              f"must be >= 1, got {self.minibatches}")
        check(0 < self.clip_low < 1, "learner.clip_low", f"must be in (0, 1), got "
              f"{self.clip_low}")
        check(math.isfinite(self.clip_high) and self.clip_high > 0, "learner.clip_high",
              f"must be a finite number > 0, got {self.clip_high}")
        check(self.clip_dual == 0 or (math.isfinite(self.clip_dual) and self.clip_dual > 1),
              "learner.clip_dual", f"must be > 1 (or 0: off), got {self.clip_dual}")
        check(self.minibatches == 1 or self.objective != "opd", "learner.minibatches",
              "> 1 splits GRPO groups into PPO mini-batches; OPD's turns stream with the "
              "teacher's advantages (use 1)")
        check(self.minibatches == 1 or self.schedule in ("sync", "group_ready",
                                                         "thundersync"),
              "learner.minibatches", f"> 1 with schedule '{self.schedule}': the old "
              f"log-probs are θ_k's, computed as sources arrive before any step; use a "
              f"synchronous schedule")
        check(self.reference_update_every >= 0, "learner.reference_update_every",
              f"must be >= 0 (0: never), got {self.reference_update_every}")
        check(bool(self.reference), "learner.reference",
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
        check(why is None, "learner.token_norm",
              f"'{self.token_norm}' {why}; use '{AUTO[kind]}'")
        sum_norm = self.token_norm == "seq_mean_token_sum_norm"
        check(self.token_norm_constant > 0 if sum_norm else self.token_norm_constant == 0,
              "learner.token_norm_constant",
              f"must be > 0 with token_norm 'seq_mean_token_sum_norm' (its H), got "
              f"{self.token_norm_constant}" if sum_norm else
              f"is H of token_norm 'seq_mean_token_sum_norm' only; token_norm is "
              f"'{self.token_norm}', so leave it 0, got {self.token_norm_constant}")
        check(self.adv_std == "population" or getattr(objective, "uses_std", False),
              "learner.adv_std", f"'{self.adv_std}': the {self.objective} objective does not "
              f"divide by the group's std (only grpo does)")
