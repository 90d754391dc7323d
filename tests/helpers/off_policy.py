"""Behaviour log-probs for off-policy tests: the HF model's own, or off by a bounded random
δ per scored token (kept away from the TIS cap, so FP32 and FP64 truncate the same tokens)."""

from __future__ import annotations

import math
import random

import torch
from transformers import AutoModelForCausalLM

CAP = 2.0


def _hf(hf_dir: str, dtype=torch.float64):
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    model.get_input_embeddings().padding_idx = None  # as reference.py: no frozen pad row
    return model


def _token_logp(model, tokens: list[int]) -> torch.Tensor:
    """log π(tokens[t] | tokens[:t]) for t ≥ 1 (index t − 1), with the graph."""
    ids = torch.tensor(tokens)
    logp = torch.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
    return logp.gather(1, ids[1:, None])[:, 0]


def _with_behaviour(model, rows: list[dict], seed: int, update: int | None = None,
                    exact: bool = False) -> list[dict]:
    """Each row with behaviour log-probs: the model's own (exact), or off by a random
    δ ∈ [−1.2, 1.2] per scored token, kept away from the cap (ln C) so that an FP32 learner
    truncates exactly the tokens the FP64 reference truncates."""
    rng = random.Random(seed)
    out = []
    for r in rows:
        with torch.no_grad():
            lp = _token_logp(model, r["tokens"]).tolist()
        b = [None]
        for t in range(1, len(r["tokens"])):
            if not r["scored_mask"][t]:
                b.append(None)
                continue
            delta = 0.0 if exact else rng.uniform(-1.2, 1.2)
            while not exact and abs(delta - math.log(CAP)) < 0.05:
                delta = rng.uniform(-1.2, 1.2)
            b.append(min(lp[t - 1] - delta, 0.0))
        extra = {} if update is None else {"update": update}
        out.append(dict(r, behaviour_logprobs=b, **extra))
    return out
