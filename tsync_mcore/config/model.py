"""The `model` section: the student checkpoint, its precision, parallel sizes and layer spec,
and its LoRA adapters (`model.lora`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tsync_mcore.config.checks import check


DType = Literal["fp32", "bf16"]
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
        check(self.rank >= 0, "model.lora.rank", f"must be >= 0, got {self.rank}")
        check(self.alpha > 0, "model.lora.alpha", f"must be > 0, got {self.alpha}")
        check(self.dropout == 0, "model.lora.dropout", "must be 0: dropout makes each "
              "forward random, and the streamed update must equal the synchronous one")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        check(not bad and bool(self.targets), "model.lora.targets",
              f"must be a non-empty list of {list(LORA_TARGETS)}, got {self.targets}")
        check(len(set(self.targets)) == len(self.targets), "model.lora.targets",
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
        check(self.tp >= 1, "model.tp", f"must be >= 1, got {self.tp}")
        check(self.autocast == "none" or self.dtype == "fp32", "model.autocast",
              f"autocasts FP32 weights; model.dtype is {self.dtype} (set fp32, or autocast none)")
        check(self.ep >= 1, "model.ep", f"must be >= 1, got {self.ep}")
        check(0 <= self.moe_aux_loss_coeff < float("inf"), "model.moe_aux_loss_coeff",
              f"must be a finite number >= 0, got {self.moe_aux_loss_coeff}")
        self.lora.validate()

    @property
    def use_lora(self) -> bool:
        return self.lora.rank > 0 or bool(self.lora_init)
