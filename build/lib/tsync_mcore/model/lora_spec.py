"""What a LoRA adapter is (rank, α, targets, rsLoRA), and PEFT's adapter_config.json.

Kept apart from model/lora.py (which needs Megatron) so that the config can read an
adapter directory's settings (`model.lora_init`) without importing the model code."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tsync_mcore.util.safe_files import BadFile, read_json_object

__all__ = ["TARGETS", "CONFIG_FILE", "LoraSpec", "LoraDirError", "read_peft_config"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
# vLLM sizes its LoRA buffers for max_lora_rank, which must be one of these.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter is: rank r, α, the HF projections it adapts, rsLoRA scaling."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    rslora: bool = False

    @property
    def scale(self) -> float:
        """PEFT's scaling: α/r, or α/√r with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def __post_init__(self) -> None:
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {list(TARGETS)}, "
                             f"got {list(self.targets)}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        # canonical order, so equal specs compare equal
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))

    def to_json(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "rslora": self.rslora}

    @classmethod
    def from_json(cls, d, where: str) -> "LoraSpec":
        """A spec `to_json` wrote (a checkpoint's meta.json); anything else is a BadFile."""
        ok = (isinstance(d, dict) and set(d) == {"rank", "alpha", "targets", "rslora"}
              and type(d["rank"]) is int and type(d["alpha"]) in (int, float)
              and math.isfinite(d["alpha"]) and d["alpha"] > 0
              and isinstance(d["targets"], list) and type(d["rslora"]) is bool
              and all(isinstance(t, str) for t in d["targets"]))
        try:
            if ok:
                return cls(d["rank"], float(d["alpha"]), tuple(d["targets"]), d["rslora"])
        except ValueError as e:
            raise BadFile(f"{where}: lora {e}") from None
        raise BadFile(f"{where}: lora must be {{rank, alpha, targets, rslora}}, got {d!r}")


class LoraDirError(BadFile):
    """A PEFT adapter directory that cannot be used; the message names the file."""


def read_peft_config(path: str) -> LoraSpec:
    """The LoraSpec of PEFT adapter directory `path` (its adapter_config.json, checked)."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        cfg = read_json_object(cfg_path)
    except BadFile as e:
        raise LoraDirError(str(e)) from None
    return _spec_from_config(cfg, cfg_path)


def _spec_from_config(cfg: dict, where: str) -> LoraSpec:
    def bad(msg: str):
        return LoraDirError(f"{where}: {msg}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type must be LORA, got {cfg.get('peft_type')!r}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if type(r) is not int or r < 1:
        raise bad(f"r must be a positive integer, got {r!r}")
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise bad(f"lora_alpha must be a positive number, got {alpha!r}")
    # what this backend does not implement: refused, never silently ignored
    for key, ok, want in (("use_dora", False, "false (DoRA is not supported)"),
                          ("bias", "none", "'none' (adapter biases are not supported)"),
                          ("fan_in_fan_out", False, "false"),
                          ("lora_bias", False, "false"),
                          ("layers_to_transform", None, "null (every layer is adapted)"),
                          ("modules_to_save", None, "null"),
                          ("target_parameters", None, "null")):
        v = cfg.get(key, ok)
        if v != ok and not (v in ({}, []) and ok is None):
            raise bad(f"{key} must be {want}, got {v!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise bad(f"{key} must be empty (one rank and α for every module), got "
                      f"{cfg[key]!r}")
    dropout = cfg.get("lora_dropout", 0.0)
    if type(dropout) not in (int, float) or dropout != 0:
        raise bad(f"lora_dropout must be 0 (the streamed update must equal the synchronous "
                  f"one), got {dropout!r}")
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGETS)
    if isinstance(targets, str) or not isinstance(targets, list) or \
            any(not isinstance(t, str) for t in targets):
        raise bad(f"target_modules must be a list of {list(TARGETS)} or 'all-linear', got "
                  f"{str(targets)[:200]!r}")
    # PEFT writes full module paths (model.layers.3.mlp.up_proj) when it expanded
    # 'all-linear'; the projection is the last component (the tensors must then cover
    # every layer, which read_peft_dir checks)
    short = sorted({t.rsplit(".", 1)[-1] for t in targets}, key=lambda t: (t not in TARGETS,
                                                                            t))
    unknown = [t for t in short if t not in TARGETS]
    if unknown or not short:
        raise bad(f"target_modules {unknown or targets!r}: supported are {list(TARGETS)}")
    targets = short
    rslora = cfg.get("use_rslora", False)
    if type(rslora) is not bool:
        raise bad(f"use_rslora must be true or false, got {rslora!r}")
    return LoraSpec(rank=r, alpha=float(alpha), targets=tuple(targets), rslora=rslora)
