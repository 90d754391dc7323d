"""The benchmark model: Qwen2 shapes, hidden 128, 4 layers, vocabulary 1024, random weights
(seed 0). Big enough that a source's learner service dwarfs per-source overheads; the
overlap benchmark and the in-process studies (packing, LoRA, reference cost) all serve it."""

from __future__ import annotations

import os

SHAPES = dict(arch="qwen2", vocab_size=1024, hidden=128, layers=4, heads=4, kv_heads=2,
              intermediate=384, seed=0)


def bench_model(hf_dir: str) -> str:
    """The benchmark model's HF checkpoint at `hf_dir` (written unless it is there); `hf_dir`."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        make_tiny_checkpoint(hf_dir, **SHAPES)
    return hf_dir
