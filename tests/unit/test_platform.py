"""CPU compatibility layer and platform helpers."""

from __future__ import annotations

import pytest
import torch

from tsync_mcore import platform

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU layer is inactive with CUDA")


def test_platform_helpers():
    assert platform.on_gpu() == torch.cuda.is_available()
    assert platform.backend() == ("nccl" if platform.on_gpu() else "gloo")
    assert platform.device().type == ("cuda" if platform.on_gpu() else "cpu")


def test_activate_idempotent():
    from tsync_mcore.platform import cpu

    cpu.activate()
    cpu.activate()
    assert cpu.is_active() == (not torch.cuda.is_available())


@cpu_only
def test_cuda_redirect_scoped():
    from tsync_mcore.platform import cpu

    with cpu.cuda_redirect():
        a = torch.zeros(3, device="cuda")
        b = torch.tensor([1.0], device=torch.device("cuda", 0))
        c = torch.ones(2).cuda()
        d = torch.ones(2).to("cuda")
        assert a.device.type == b.device.type == c.device.type == d.device.type == "cpu"
        assert a.type() == "torch.cuda.FloatTensor"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(3, device="cuda")


@cpu_only
def test_cpu_patches_and_rng_tracker(parallel1):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.utils import get_default_causal_mask
    from megatron.core.utils import GlobalMemoryBuffer

    from tsync_mcore.platform import cpu

    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    assert buf.device.type == "cpu"
    mask = get_default_causal_mask(4)
    assert mask.dtype == torch.bool and mask.device.type == "cpu" and mask[0, 1] and not mask[1, 0]

    cpu.seed_all(7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert isinstance(tracker, cpu.CpuRNGStatesTracker)
    before = torch.get_rng_state()
    with tracker.fork():
        x = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    cpu.seed_all(7)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        y = torch.rand(4)
    assert torch.equal(x, y)  # reproducible per seed
    with tensor_parallel.get_cuda_rng_tracker().fork():
        z = torch.rand(4)
    assert not torch.equal(y, z)  # the forked stream advances


@cpu_only
def test_recompute_checkpoint_on_cpu(parallel1):
    """tensor_parallel.checkpoint saves/restores RNG through the patched CPU helpers."""
    from megatron.core import tensor_parallel

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)

    def f(inp):
        return torch.nn.functional.dropout(inp @ w, p=0.5, training=True)

    torch.manual_seed(0)
    y = tensor_parallel.checkpoint(f, False, x)
    y.sum().backward()
    g_ckpt = w.grad.clone()
    w.grad = None
    torch.manual_seed(0)
    f(x).sum().backward()
    assert torch.equal(g_ckpt, w.grad)  # same dropout mask in the recomputation


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA Megatron's jit_fuser stays as it is")
def test_megatron_fusions_are_not_compiled_on_a_cpu():
    """tsync_mcore's import hook (util/megatron_import.py) ran Megatron's disable_jit_fuser()
    as megatron.core.jit loaded: its fusion functions are plain functions, not torch.compile
    wrappers (decorating with torch.compile imports inductor in every process)."""
    import megatron.core.jit as jit
    from megatron.core.fusions import fused_bias_gelu

    assert jit.jit_fuser is jit.noop_decorator
    assert type(fused_bias_gelu.bias_gelu).__name__ == "function"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA Megatron imports wandb as it is")
def test_megatron_logging_modules_load_without_wandb_on_a_cpu(monkeypatch):
    """The same hook runs Megatron's timers (and its inference engine's modules) with
    `import wandb` failing, so they take their own `except ImportError` branch; the hook
    leaves the import system as it was afterwards (a run's wandb tracker imports it then)."""
    import importlib
    import importlib.machinery
    import sys

    from tsync_mcore.util import megatron_import

    name = "megatron.core.timers"
    spec = importlib.machinery.PathFinder.find_spec(name, importlib.import_module("megatron.core").__path__)
    for mod in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, mod)  # as in a process that has not imported it
    spec.loader = megatron_import._OnCpu(spec.loader, name)
    module = importlib.util.module_from_spec(spec)  # a fresh copy, not registered
    spec.loader.exec_module(module)
    assert module.wandb is None and "wandb" not in sys.modules
    assert not any(isinstance(f, megatron_import._NoWandb) for f in sys.meta_path)
    assert importlib.util.find_spec("wandb") is not None  # still importable
