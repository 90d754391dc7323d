"""torch.distributed + Megatron-Core parallel state: one call per process."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from tsync_mcore import platform
from tsync_mcore.platform import cpu
from tsync_mcore.util.net import free_port as _free_port

__all__ = ["ParallelInfo", "init_parallel", "destroy_parallel"]


@dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    # gloo DP group: CPU-side collectives (metadata, counts) on both CPU and GPU
    dp_group_gloo: dist.ProcessGroup




def _init_process_group(timeout: timedelta) -> None:
    backend = platform.backend()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # torchrun: env:// reads MASTER_ADDR/PORT, RANK, WORLD_SIZE.
        if platform.on_gpu():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # Plain `python`: a single-process group on a free localhost port.
    if platform.on_gpu():
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


def init_parallel(tp_size: int = 1, seed: int = 1234, timeout_s: float = 600.0,
                  ep_size: int = 1) -> ParallelInfo:
    """Initialize torch.distributed (if needed) and megatron's TP x DP groups, then seed.

    `ep_size` (model.ep) splits each MoE layer's experts over that many data-parallel ranks
    (megatron's expert-parallel group); dense layers stay data-parallel over all of them.

    `timeout_s` (launch.dist_timeout_s) bounds the rendezvous and every collective of the
    default group and of megatron's groups (theirs defaults to 30 minutes), so a peer that
    is gone ends the run after it. Idempotent for the same `tp_size`; a different one
    re-creates megatron's groups (likewise `ep_size`).
    """
    timeout = timedelta(seconds=timeout_s)
    if not platform.on_gpu():
        cpu.activate()
    if not dist.is_initialized():
        _init_process_group(timeout)
        if not platform.on_gpu():
            # why: left to interpreter teardown, gloo's worker threads can free tensors after
            # the interpreter is gone (SIGABRT, "terminate called without an active exception",
            # seen once after a clean 2-rank replay); gloo teardown is local, so doing it at
            # exit is safe even on an error path. NCCL's is not (it can wait on peers that
            # failed): GPU entry points destroy explicitly after a clean finish.
            atexit.register(destroy_parallel)
    world = dist.get_world_size()
    if world % tp_size != 0:
        raise ValueError(f"world size {world} is not divisible by tp_size {tp_size}")
    # megatron: experts are split over tp (expert TP) x ep ranks, so both must tile the world
    if ep_size < 1 or world % (tp_size * ep_size) != 0:
        raise ValueError(f"world size {world} is not divisible by tp_size {tp_size} x "
                         f"ep_size {ep_size}")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() != tp_size
                or ps.get_expert_model_parallel_world_size() != ep_size):
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                     expert_model_parallel_size=ep_size,
                                     distributed_timeout_minutes=timeout_s / 60)
    cpu.seed_all(seed)
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=world,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_group_gloo=ps.get_data_parallel_group_gloo(),
    )


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (if any)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_json(value, device: torch.device | str = "cpu") -> list:
    """Every rank's JSON-able `value`, in rank order: UTF-8 JSON bytes in uint8 tensors.

    Instead of all_gather_object, which unpickles what peers send: learner ranks on other
    hosts are peers across a network, so their bytes are parsed as JSON and nothing else.
    A rank whose bytes do not parse is named (ValueError)."""
    import json
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [value]
    raw = json.dumps(value).encode()
    n = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    out = []
    for r, (b, s) in enumerate(zip(bufs, sizes)):
        try:
            out.append(json.loads(bytes(b[:int(s.item())].cpu().tolist()).decode()))
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"learner rank {r} sent a value that is not UTF-8 JSON "
                             f"({type(e).__name__})") from None
    return out
