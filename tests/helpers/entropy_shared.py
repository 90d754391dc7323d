"""Shared by the tests of the learner's entropy metric: tests/integration/test_learner_metrics.py
(TP = 1, live) and tests/integration/test_lm_head.py (TP = 2, in the head's launch)."""

from __future__ import annotations

import torch

from tests.helpers.batchgen import make_batch

VOCAB = 256
ENT_TOL = 1e-5  # FP32 learner vs FP64 reference


def entropy_rows() -> list[dict]:
    return make_batch(VOCAB, n_groups=3, m=3, version=0, seed=5)


def reference_entropy(hf_dir: str, rows: list[dict], weights: dict | None = None):
    """(Σ entropy, scored tokens): full softmax in float64 at every scored position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    if weights is not None:
        model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=True)
    total, n = 0.0, 0
    with torch.no_grad():
        for r in rows:
            pos = [p for p, s in enumerate(r["scored_mask"]) if s]
            if not pos:
                continue
            logits = model(torch.tensor(r["tokens"])[None]).logits[0]
            logp = torch.log_softmax(logits[torch.tensor(pos) - 1], dim=-1)
            total += float(-(logp.exp() * logp).sum())
            n += len(pos)
    return total, n
