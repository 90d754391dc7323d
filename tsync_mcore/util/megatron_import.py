"""Megatron-Core's import on a machine without CUDA: no inductor for fusions that never run.

megatron/core/jit.py sets `jit_fuser = torch.compile` when it is imported, and Megatron's
fusion modules decorate with it as they are imported, which loads torch's inductor in every
process that imports megatron.core: about a second of CPU per learner rank, replay and
test worker, for fused kernels the model build turns off (`bias_activation_fusion`,
`bias_dropout_fusion`, `apply_rope_fusion`: model/bridge/build.py). `install()` (run by
`tsync_mcore/__init__.py`) adds a one-shot import hook: right after megatron.core.jit has
run, before any fusion module reads `jit_fuser`, it calls Megatron's own
`disable_jit_fuser()` where CUDA is absent. With CUDA it changes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_JIT = "megatron.core.jit"


class _DisableOnCpu(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        import torch

        if not torch.cuda.is_available():
            module.disable_jit_fuser()


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _JIT:
            return None
        sys.meta_path.remove(self)  # one shot: the module is found once
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisableOnCpu(spec.loader)
        return spec


def install() -> None:
    """Add the hook, unless megatron.core.jit is imported already (then it is too late)."""
    if _JIT not in sys.modules and not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
