"""Megatron DDP (flat FP32 grad buffers, SUM over DP) and the Megatron optimizer.

Gradient flow: backward accumulates raw, unscaled grads into `param.main_grad`, views into
one flat FP32 buffer per dtype (`grad_buffers`). `finish_grad_sync` reduces them across DP
ranks as a SUM (all-reduce, or reduce-scatter into each rank's shard with the distributed
optimizer; see `reduced_grad_ranges`) and completes TP-replicated grads (qk-norm).
`optimizer_step` clips by the global norm and applies Adam. Zero the buffers between
steps with `ddp.zero_grad_buffer()`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import (OptimizerParamScheduler,
                                                     get_canonical_lr_for_logging)

from tsync_mcore.platform import cpu

__all__ = [
    "wrap_ddp",
    "grad_buffers",
    "flat_grad_numel",
    "reduced_grad_ranges",
    "finish_grad_sync",
    "build_optimizer",
    "build_scheduler",
    "current_lr",
    "optimizer_step",
    "set_scheduler_position",
]


def wrap_ddp(
    model: torch.nn.Module, *, use_distributed_optimizer: bool = True
) -> DistributedDataParallel:
    """Megatron DDP whose DP reduction is a SUM of the ranks' gradients (no 1/DP)."""
    # why: with calculate_per_token_loss, mcore 0.16.1 DDP sets gradient_scaling_factor=1.0;
    # otherwise it pre-scales every bucket by 1/dp before its SUM collective (a mean). The
    # flag is only read by DDP and by MTP/MoE losses, which we do not use.
    model.config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,  # AVG collective would divide by dp again
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for bucket in group.buckets:
            assert bucket.gradient_scaling_factor == 1.0, "DP reduction must be a SUM"
    return ddp


def grad_buffers(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    """The flat FP32 grad tensors of all DDP buffers (`param.main_grad` are views into them)."""
    return [buf.grad_data for buf in ddp.buffers + ddp.expert_parallel_buffers]


def grad_buffer_groups(ddp: DistributedDataParallel) -> list[dist.ProcessGroup]:
    """Per `grad_buffers` entry, the group DDP reduces it over: data-parallel for dense
    parameters, expert-data-parallel (DP / EP ranks) for routed experts."""
    return [buf.data_parallel_group for buf in ddp.buffers + ddp.expert_parallel_buffers]


def flat_grad_numel(ddp: DistributedDataParallel) -> int:
    """Total elements in `grad_buffers(ddp)` (params plus bucket padding)."""
    return sum(t.numel() for t in grad_buffers(ddp))


def reduced_grad_ranges(ddp: DistributedDataParallel) -> list[list[tuple[int, int]]]:
    """Per grad buffer, the [start, end) ranges that hold the DP-reduced sum after
    `finish_grad_sync` on this rank: the whole buffer for an all-reduce, this rank's shard of
    every bucket with the distributed optimizer (reduce-scatter)."""
    out = []
    for buf in ddp.buffers + ddp.expert_parallel_buffers:
        if not ddp.ddp_config.use_distributed_optimizer:
            out.append([(0, buf.grad_data.numel())])
            continue
        size, rank = buf.data_parallel_world_size, buf.data_parallel_group.rank()
        ranges = []
        for bucket in buf.buckets:
            shard = bucket.grad_data.numel() // size
            ranges.append((bucket.offset + rank * shard, bucket.offset + (rank + 1) * shard))
        out.append(ranges)
    return out


def finish_grad_sync(ddp: DistributedDataParallel) -> None:
    """SUM-reduce the grad buffers across DP ranks (blocking; overlap is off), then make
    TP-replicated grads complete.

    Uses megatron's `finalize_model_grads`: besides `ddp.finish_grad_sync()` it all-reduces
    over TP the grads of params that are replicated but see only a TP shard of the
    activations (Qwen3 q/k-layernorm weights: partial per TP rank before this).
    """
    finalize_model_grads([ddp])


def build_optimizer(
    ddp: DistributedDataParallel,
    *,
    lr: float = 1e-6,
    min_lr: float | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    use_distributed_optimizer: bool = True,
    bf16: bool,
) -> MegatronOptimizer:
    """Megatron Adam over `ddp` (FP32 main params for bf16 models; sharded state if distributed).

    `use_distributed_optimizer` must match the value given to `wrap_ddp`. `min_lr` (default:
    `lr`) is where a decaying `build_scheduler` schedule ends; Megatron copies it into every
    param group, where the scheduler reads it.
    """
    if use_distributed_optimizer != ddp.ddp_config.use_distributed_optimizer:
        raise ValueError("use_distributed_optimizer must match the DDP wrapper's setting")
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr if min_lr is None else min_lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    # why: optimizer construction creates device='cuda' tensors and checks torch.cuda types.
    with cpu.cuda_redirect():
        optimizer = get_megatron_optimizer(config, [ddp])
    _fuse_cpu_adam(optimizer)
    return optimizer


def _fuse_cpu_adam(optimizer: MegatronOptimizer) -> None:
    """torch's fused AdamW for main params on the CPU: Megatron builds torch's AdamW with its
    default (foreach), several passes over every state tensor; the fused kernel makes one
    (perf/README, "optimizer"). Same update up to FP32 rounding."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if params and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)


def build_scheduler(
    optimizer: MegatronOptimizer,
    *,
    lr: float,
    min_lr: float,
    style: str,
    warmup_steps: int,
    decay_steps: int,
    weight_decay: float,
) -> OptimizerParamScheduler:
    """Megatron's LR / weight-decay scheduler over `optimizer`, at step 0 (sets every group).

    Step it once per applied optimizer step. The weight decay is constant; the scheduler
    writes `weight_decay · wd_mult` into each group, and Megatron's param groups give biases
    and 1-D parameters (norms) wd_mult 0, as Megatron-LM trains.
    `override_opt_param_scheduler`: on `load_state_dict` the configured values win and the
    checkpoint gives the position (num_steps), as this project's checkpoints do everywhere.
    """
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=style, start_wd=weight_decay,
        end_wd=weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def current_lr(optimizer: MegatronOptimizer) -> float:
    """The learning rate the next step applies (Megatron's logged LR: the default groups')."""
    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(lr if lr is not None else optimizer.param_groups[0]["lr"])


def optimizer_step(optimizer: MegatronOptimizer) -> tuple[bool, float]:
    """One step (global-norm clip + Adam, params re-gathered): (update ok, grad norm)."""
    # why: clip-grad and found-inf checks allocate device='cuda' tensors.
    with cpu.cuda_redirect():
        ok, grad_norm, _ = optimizer.step()
    return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")


def set_scheduler_position(scheduler: OptimizerParamScheduler, num_steps: int) -> None:
    """Put `scheduler` at `num_steps` applied steps and set every group's LR and weight decay
    (Megatron's `load_state_dict` adds to the current count instead)."""
    scheduler.num_steps = num_steps
    scheduler.step(0)
