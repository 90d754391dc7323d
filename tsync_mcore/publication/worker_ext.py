"""vLLM worker extension: in-place weight reload from an HF-named safetensors file, or
from the publication group (`tsync_mcore.publication.dist`), and a digest of what the model
holds (for tests and checks).

Loaded by qualified name inside vLLM's engine-core process (``worker_extension_cls``), so
it must stay importable without the rest of the package's heavy modules.
"""

from __future__ import annotations

import hashlib
import re
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
        self._tsync_reload(iter(tensors.items()))
        return time.perf_counter() - t0

    def _tsync_reload(self, weights) -> None:
        """vLLM's in-place reload of HF-named tensors, then the MoE repack it skips."""
        names: set[str] = set()

        def seen():
            for name, t in weights:
                names.add(name)
                yield name, t

        self.reload_weights(weights_iterator=seen(),  # type: ignore[attr-defined]
                            is_checkpoint_format=True)
        _repack_reloaded_experts(self.model_runner.get_model(), names)  # type: ignore[attr-defined]

    # --- publication over torch.distributed ------------------------------------------------

    def tsync_join_publish_group(self, addr: str, port: int, rank: int, world: int,
                                 token: str, timeout_s: float, ifname: str = "",
                                 backend: str = "", key: str = "") -> int:
        """Join the publication group as `rank` + this worker's rank in its engine (blocks
        until every member joined); returns the group rank taken."""
        import torch

        from tsync_mcore.publication.dist import Receiver, join_group

        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        me = rank + int(getattr(self, "rank", 0))
        pg = join_group(addr, port, me, world, token=token, timeout_s=timeout_s,
                        backend=backend, ifname=ifname, key=bytes.fromhex(key) if key else None)
        self._tsync_receiver = Receiver(pg, self._tsync_known_shapes(), backend)
        return me

    def tsync_receive(self, version: int, n_buckets: int, delta: bool) -> dict:
        """Receive θ_version from the group and load it bucket by bucket. The control
        block and header are checked before anything is loaded. Returns seconds, bytes
        received and (delta) the checksum of the weights now held."""
        recv = getattr(self, "_tsync_receiver", None)
        if recv is None:
            raise RuntimeError("tsync_receive: this worker has not joined a publication group")
        t0 = time.perf_counter()
        params, buckets, got = recv.begin(version, n_buckets, delta)
        self._tsync_reload(recv.tensors(params, buckets, got))
        return {"seconds": time.perf_counter() - t0, "bytes": got.bytes,
                "checksum": got.checksum}

    def tsync_known_names(self) -> int:
        return len(self._tsync_known_shapes())

    def _tsync_known_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name → shape of every tensor of the checkpoint the engine started from (read
        from the safetensors headers only): what a publication may name."""
        import glob
        import os

        from safetensors import safe_open

        cached = getattr(self, "_tsync_shapes", None)
        if cached is not None:
            return cached
        root = self.model_runner.model_config.model  # type: ignore[attr-defined]
        shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(glob.glob(os.path.join(root, "*.safetensors"))):
            with safe_open(f, framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        if not shapes:
            raise RuntimeError(f"no safetensors files under {root}: cannot check publications")
        self._tsync_shapes = shapes
        return shapes

    def tsync_param_digest(self) -> dict[str, str]:
        """vLLM parameter and buffer name → SHA-256 of the bytes the model holds now (its
        own, fused and repacked layout): two loads gave the same weights iff equal."""
        import torch

        out: dict[str, str] = {}
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        named = [*model.named_parameters(), *model.named_buffers()]
        for name, t in named:
            t = t.detach().contiguous().cpu().reshape(-1)
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest()
        return out


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _repack_reloaded_experts(model, names: set[str]) -> None:
    """Redo the experts' own weight processing for the MoE layers `names` reloaded.

    why: vLLM 0.32's UnquantizedFusedMoEMethod._setup_kernel runs
    `moe_kernel.fused_experts.process_weights_after_loading` on the first load only; a
    reload copies the new checkpoint-layout experts into the kernel tensors and stops.
    That hook is a no-op for the GPU kernels, but the CPU experts prepack w13/w2 there
    (cpu_prepack_moe_weight), so without this the CPU engine computes with unpacked
    weights read as packed ones. Layers the reload did not touch hold packed weights
    already and must not be packed twice.
    """
    touched = {int(m.group(1)) for n in names if ".mlp.experts." in n
               and (m := _LAYER.search(n))}
    if not touched:
        return
    for mod_name, mod in model.named_modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # only vLLM's CPU experts: other kernels' hooks are no-ops or not known to be
        # safe to run twice
        if not type(experts).__module__.endswith(".cpu_moe"):
            continue
        m = _LAYER.search(mod_name + ".")
        if m is None or int(m.group(1)) not in touched:
            continue
        cfg = getattr(experts, "moe_config", None)
        pad = getattr(experts, "_padded_intermediate_size", None)
        if cfg is not None and pad is not None \
                and pad(cfg) != cfg.intermediate_size_per_partition:
            raise RuntimeError(f"{mod_name}: in-place reload of CPU MoE experts whose "
                               f"intermediate size {cfg.intermediate_size_per_partition} "
                               f"vLLM pads is not supported (restart the engine instead)")
        experts.process_weights_after_loading(mod)
