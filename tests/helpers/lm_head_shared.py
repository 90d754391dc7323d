"""Shared by the tests of lm head: tests/unit/test_lm_head.py, tests/integration/test_lm_head.py."""

from __future__ import annotations

import importlib.util
import os

import torch

from tests.helpers.paths import WORKERS
from tsync_mcore.kernels import fused_lm_head_logprob


WORKER = os.path.join(WORKERS, "lm_head_worker.py")
_spec = importlib.util.spec_from_file_location("lm_head_worker", WORKER)
hw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hw)


TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def reference(hidden, weight, targets, grad, grad_ent=None):
    """FP64: logp, entropy, d(Σ grad·logp [+ grad_ent·entropy])/d hidden and / d weight,
    from the full logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logsm = torch.log_softmax(h @ w.t(), dim=-1)
    logp = logsm.gather(1, targets[:, None].clamp(0, w.shape[0] - 1))[:, 0]
    ent = -(logsm.exp() * logsm).sum(-1)
    loss = (logp * grad.double()).sum()
    if grad_ent is not None:
        loss = loss + (ent * grad_ent.double()).sum()
    loss.backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def err(got, ref) -> float:
    """Max abs error relative to the reference's largest magnitude (at least 1)."""
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def fused(hidden, weight, targets, grad, chunk, grad_ent=None):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, ent = fused_lm_head_logprob(h, w, targets, chunk=chunk, with_entropy=True)
    loss = (logp * grad).sum()
    if grad_ent is not None:  # an entropy bonus: its gradient in the same chunked backward
        loss = loss + (ent * grad_ent).sum()
    loss.backward()
    return logp.detach(), ent.detach(), h.grad, w.grad
