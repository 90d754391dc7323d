"""Megatron-Core's import on a machine without CUDA: no inductor for fusions that never run.

megatron/core/jit.py sets `jit_fuser = torch.compile` when it is imported, and Megatron's
fusion modules decorate with it as they are imported, which loads torch's inductor in every
process that imports megatron.core: about a second of CPU per learner rank, replay and
test worker, for fused kernels the model build turns off (`bias_activation_fusion`,
`bias_dropout_fusion`, `apply_rope_fusion`: model/bridge/build.py). `install()` (run by
`tsync_mcore/__init__.py`) adds a one-shot import hook: right after megatron.core.jit has
run, before any fusion module reads `jit_fuser`, it calls Megatron's own
`disable_jit_fuser()` where CUDA is absent. With CUDA it changes nothing.

The same hook keeps Megatron's inference engine and timers from importing wandb (their
optional metrics logger, which no part of this project uses) where CUDA is absent: those
modules import it inside `try/except ImportError`, and it costs about half a second per
process. Our own tracker imports wandb when a run selects it, unaffected.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_JIT = "megatron.core.jit"
# Megatron modules that import wandb only to log their own metrics (inference engine, timers).
_WANDB_OPTIONAL = ("megatron.core.inference.contexts.dynamic_context",
                   "megatron.core.inference.engines.dynamic_engine", "megatron.core.timers")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


class _NoWandb(importlib.abc.MetaPathFinder):
    """While a module in _WANDB_OPTIONAL runs: `import wandb` raises ImportError."""

    def find_spec(self, name, path, target=None):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("wandb: not loaded for Megatron's own loggers on a CPU "
                              "(tsync_mcore/util/megatron_import.py)")
        return None


class _OnCpu(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if self.name == _JIT:
            self.loader.exec_module(module)
            if _no_cuda():
                module.disable_jit_fuser()
            return
        block = "wandb" not in sys.modules and _no_cuda()
        blocker = _NoWandb()
        if block:
            sys.meta_path.insert(0, blocker)
        try:
            self.loader.exec_module(module)
        finally:
            if block:
                sys.meta_path.remove(blocker)


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.waiting = {_JIT, *_WANDB_OPTIONAL}

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        if not self.waiting:
            sys.meta_path.remove(self)  # each module is found once
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _OnCpu(spec.loader, name)
        return spec


def install() -> None:
    """Add the hook, unless megatron.core.jit is imported already (then it is too late)."""
    if _JIT not in sys.modules and not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
