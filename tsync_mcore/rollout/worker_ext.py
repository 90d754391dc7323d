"""vLLM worker extension: in-place weight reload from an HF-named safetensors file.

Loaded by qualified name inside vLLM's engine-core process (``worker_extension_cls``), so
it must stay importable without the rest of the package's heavy modules.
"""

from __future__ import annotations

import time


class ReloadExtension:
    """Mixed into vLLM's worker class; methods are reached via ``collective_rpc``."""

    def tsync_reload_from_file(self, path: str) -> float:
        """Load every tensor of `path` (HF parameter names) into the running model.

        Goes through the worker's ``reload_weights`` (checkpoint format), not
        ``model.load_weights``: on CPU the latter leaves repacked linear weights empty.
        Tensors cross the RPC boundary as a path, never as tensors (they would arrive as
        Python lists). Returns the seconds the reload took inside the worker.
        """
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        tensors = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(tensors.items()),  # type: ignore[attr-defined]
                            is_checkpoint_format=True)
        return time.perf_counter() - t0
