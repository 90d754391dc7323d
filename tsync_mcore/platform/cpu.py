"""Megatron-Core 0.16.1 on a CPU-only torch: the few patches that make it run (gloo ranks).

Only ever active without CUDA: `activate()` is a no-op when `torch.cuda.is_available()`.
The obstacles and their fixes are listed, numbered, in docs/design/cpu-platform.md; each patch
below names the megatron call sites it covers.

- `torch.cuda.current_device` -> CPU device, `torch.cuda.synchronize` -> no-op (obstacles
  3, 5, 7): megatron allocates on `torch.cuda.current_device()` in GlobalMemoryBuffer (attention
  and TP-gather scratch), RotaryEmbedding.get_emb (moves inv_freq), DDP grad/param buffers,
  TP mappings and the distributed optimizer's buffers; one root patch covers all of them.
- RNG (obstacles 1, 2): a tracker that forks the CPU generator replaces the CUDA tracker, and
  the recompute-checkpoint get/set-RNG helpers read/write the CPU generator.
- Causal masks (obstacle 4): the default/sliding-window masks are built on "cuda"; build on CPU.
- `cuda_redirect()` (obstacle 8): the optimizer, grad clipping and grad scaler create
  `device='cuda'` tensors, call `.cuda()` and compare `param.type()` with
  `torch.cuda.FloatTensor`; a TorchFunctionMode scoped around optimizer build and step
  redirects those to the CPU.
- MoE all-to-all dispatch (obstacle 11): the dispatcher copies its split sizes to the host
  on a side CUDA stream; on the CPU they are host tensors already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as _mrandom
from torch.overrides import TorchFunctionMode

__all__ = ["activate", "is_active", "seed_all", "cuda_redirect", "CpuRNGStatesTracker"]

_CPU = torch.device("cpu")
_active = False


def is_active() -> bool:
    return _active


def activate() -> None:
    """Install the CPU patches once; no-op with CUDA or when already active."""
    global _active
    if _active or torch.cuda.is_available():
        return
    _patch_cuda_device_queries()
    _patch_rng()
    _patch_causal_masks()
    _patch_moe_alltoall()
    _patch_linear_autocast()
    _active = True


def _patch_linear_autocast() -> None:
    """Megatron decorates its linear autograd Functions with CUDA's custom_fwd/custom_bwd:
    their backward restores CUDA's autocast state, not the CPU's, so under
    torch.autocast("cpu") (model.autocast) the backward would multiply BF16 gradients by
    FP32 weights. Record the CPU autocast state in forward and restore it in backward."""
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication,
                layers.LinearWithFrozenWeight):
        fwd, bwd = cls.forward, cls.backward

        def forward(ctx, *args, _fwd=fwd, **kwargs):
            ctx.cpu_autocast = torch.get_autocast_dtype("cpu") \
                if torch.is_autocast_enabled("cpu") else None
            return _fwd(ctx, *args, **kwargs)

        def backward(ctx, *grads, _bwd=bwd):
            if getattr(ctx, "cpu_autocast", None) is None:
                return _bwd(ctx, *grads)
            with torch.autocast("cpu", dtype=ctx.cpu_autocast):
                return _bwd(ctx, *grads)

        cls.forward, cls.backward = staticmethod(forward), staticmethod(backward)


# --------------------------------------------------------------------------- device queries


def _cpu_current_device() -> torch.device:
    return _CPU


def _noop_synchronize(device: Any = None) -> None:
    return None


def _patch_cuda_device_queries() -> None:
    # why: megatron passes torch.cuda.current_device() as `device=` for buffers (DDP,
    # GlobalMemoryBuffer, RoPE inv_freq, TP gathers); a CPU device keeps them on the CPU.
    torch.cuda.current_device = _cpu_current_device
    # why: DDP / parallel_state call torch.cuda.synchronize() around buffer (re)allocation.
    torch.cuda.synchronize = _noop_synchronize


# --------------------------------------------------------------------------- RNG

def _cpu_get_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


class CpuRNGStatesTracker(_mrandom.CudaRNGStatesTracker):
    """Megatron's named RNG-state tracker, over the CPU default generator.

    Subclassing keeps `isinstance(..., CudaRNGStatesTracker)` checks in megatron true.
    """

    def __init__(self) -> None:
        super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

    def add(self, name: str, seed: int) -> None:
        # why: the base class seeds via torch.cuda.manual_seed/get_rng_state.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        # why: the base fork warns whenever the CPU state changes inside, which is the point
        # here (the forked state *is* the CPU generator).
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def _install_cpu_tracker() -> CpuRNGStatesTracker:
    tracker = CpuRNGStatesTracker()
    _mrandom._CUDA_RNG_STATE_TRACKER = tracker
    _mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def _patch_rng() -> None:
    # why: tensor_parallel.checkpoint (activation recompute) saves/restores the "cuda" RNG
    # state through these two module-level helpers.
    _mrandom._get_cuda_rng_state = _cpu_get_rng_state
    _mrandom._set_cuda_rng_state = _cpu_set_rng_state
    # why: get_cuda_rng_tracker() would otherwise build a CUDA tracker (fails in add()).
    _install_cpu_tracker()


def seed_all(seed: int) -> None:
    """Seed torch and megatron's RNG tracker like `model_parallel_cuda_manual_seed`.

    Same seeds as megatron: data-parallel = seed, tensor-parallel = seed + 2718 + tp_rank,
    expert = seed + 1024 + 100 * ep_rank + etp_rank. Needs parallel_state initialized.
    """
    from megatron.core import parallel_state as ps

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        _mrandom.model_parallel_cuda_manual_seed(seed)
        return
    activate()
    tracker = _install_cpu_tracker()
    tracker.add(_mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        _mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + 2718 + ps.get_tensor_model_parallel_rank(),
    )
    tracker.add(
        _mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed
        + 1024
        + 100 * ps.get_expert_model_parallel_rank()
        + ps.get_expert_tensor_parallel_rank(),
    )


# --------------------------------------------------------------------------- causal masks


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _patch_causal_masks() -> None:
    # why: with attention_mask=None megatron builds these masks with device="cuda";
    # fused_softmax imported the functions by name, so patch both modules.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = _cpu_default_causal_mask
        mod.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask


# --------------------------------------------------------------------------- MoE dispatch


def _host_numpy(t: Any) -> Any:
    return t.numpy() if torch.is_tensor(t) else t


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert: Any = None) -> Any:
    # why: megatron's version does these copies inside `torch.cuda.stream(...)` and waits on
    # a CUDA event; the splits must still become numpy arrays, as all-to-all reads them so.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _host_numpy(self.input_splits)
        self.output_splits = _host_numpy(self.output_splits)
        self.output_splits_tp = _host_numpy(self.output_splits_tp)
    return tokens_per_expert


def _patch_moe_alltoall() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # why: __init__ creates the side stream (torch.cuda.Stream) once, when this is None.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


# --------------------------------------------------------------------------- cuda_redirect


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # a bare int device index means a CUDA device in torch factories
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaRedirectMode(TorchFunctionMode):
    """device='cuda' -> CPU, `.cuda()` -> self, `.type()` reports the torch.cuda.* name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # why: optimizer builders accept only 'torch.cuda.{Float,Half,BFloat16}Tensor'.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_redirect() -> Iterator[None]:
    """Scope for megatron code that hard-codes CUDA (optimizer build and step); no-op on GPU."""
    if torch.cuda.is_available():
        yield
        return
    activate()
    with _CudaRedirectMode():
        yield
