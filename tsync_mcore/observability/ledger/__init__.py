"""Measurement layer (docs/guide/metrics.md#measurement-metrics-traces-mfu-the-speedup-predictor-and-the-report): learner FLOPs, MFU, NVML timeline, peak memory,
host cost per served source (ops, synchronising calls, host time: `host.HostCounter`).

Importing this package pulls in neither megatron nor pynvml; `flops.load_spec` and the NVML
sampler import them when used.
"""

from tsync_mcore.observability.ledger.flops import (
    FlopBreakdown,
    LoraShape,
    ep_rank_flops,
    forward_flops,
    frozen_names,
    head_recompute_flops,
    load_spec,
    replay_flops,
    span_flops,
    train_flops,
)
from tsync_mcore.observability.ledger.moe import MoeShape, RoutingCounter, load_moe
from tsync_mcore.observability.ledger.host import HostCounter
from tsync_mcore.observability.ledger.memory import MemoryMeter
from tsync_mcore.observability.ledger.mfu import Peak, detect_peak, mfu_active, steady_state
from tsync_mcore.observability.ledger.nvml import NvmlSampler

__all__ = [
    "FlopBreakdown",
    "HostCounter",
    "LoraShape",
    "MemoryMeter",
    "MoeShape",
    "NvmlSampler",
    "Peak",
    "detect_peak",
    "ep_rank_flops",
    "forward_flops",
    "frozen_names",
    "head_recompute_flops",
    "load_moe",
    "load_spec",
    "mfu_active",
    "replay_flops",
    "RoutingCounter",
    "span_flops",
    "steady_state",
    "train_flops",
]
