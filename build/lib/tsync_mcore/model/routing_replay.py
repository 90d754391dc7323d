"""Routing replay for Megatron-Core MoE routers: force, or record, each token's experts.

Megatron-Core 0.16 ships the mechanism (`megatron.core.transformer.moe.router_replay`):
with `TransformerConfig.moe_enable_routing_replay=True` every `TopKRouter` owns a
`RouterReplay`, whose action decides the top-k inside `topk_routing_with_score_function`:

- RECORD: route as usual and keep the chosen indices;
- REPLAY_FORWARD: take the indices set with `set_target_indices` and gather the router's
  scores at them (for Qwen3-MoE, `moe_router_pre_softmax=False`: the softmax of the gathered
  logits, i.e. HF's `norm_topk_prob` renormalisation over the forced experts);
- REPLAY_BACKWARD: the same, popping queued indices (one set per micro-batch whose
  forward ran before its backward).

Megatron's own helpers act on a process-global list of every router ever built; these act
on the routers of one model only, so a policy and a second MoE model (a reference) in one
process cannot swap routings.

Rows are in the router's token order for that forward: Megatron is sequence-first, so
[s, b, h] flattens to row s * b + b_idx (b = 1: the position). Under sequence parallelism
a rank routes its own s / tp slice; with expert parallelism routing happens before the
all-to-all, so each rank still gives the rows of its own tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch


def model_replays(model: torch.nn.Module) -> list:
    """The `RouterReplay` of each MoE router of `model`, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    if replays and any(r is None for r in replays):
        raise ValueError("routing replay needs TransformerConfig.moe_enable_routing_replay=True")
    return replays


def _clear(replays: list) -> None:
    for r in replays:
        r.clear_indices()
        r.clear_router_replay_action()


@contextmanager
def forced_routing(model: torch.nn.Module, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, every forward of `model` routes row t of MoE layer l to the
    experts `experts[t, l, :]` (an integer tensor [tokens, moe_layers, topk]).

    Run the backward inside the block too: an activation-recompute forward then reads
    the same target. (Megatron's REPLAY_BACKWARD queue is for schedules that run several
    micro-batches' forwards before their backwards, each with its own routing; the
    learner forwards and backwards one unit at a time.)"""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = model_replays(model)
    if experts.dim() != 3 or experts.shape[1] != len(replays):
        raise ValueError(f"forced routing: expected experts [tokens, {len(replays)} MoE "
                         f"layers, topk], got shape {tuple(experts.shape)}")
    if experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise ValueError(f"forced routing: expert ids must be integers, got {experts.dtype}")
    ids = experts.long()
    for layer, r in enumerate(replays):
        r.set_target_indices(ids[:, layer, :])
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        _clear(replays)


@contextmanager
def recorded_routing(model: torch.nn.Module) -> Iterator[dict]:
    """Record the experts `model` chooses in the one forward run within the block; on
    exit `out["experts"]` is a [tokens, moe_layers, topk] int64 tensor (the learner's
    own routing under θ_k: `learner.routing_replay: learner`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = model_replays(model)
    out: dict = {}
    for r in replays:
        r.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        got = [r.get_recorded_indices() for r in replays]
        if any(g is None for g in got):
            raise RuntimeError("recorded routing: a MoE layer routed no tokens in the block")
        out["experts"] = torch.stack([g.detach().long() for g in got], dim=1)
    finally:
        _clear(replays)


def _guided_topk(given: torch.Tensor | None, used: dict, layer: int, scores: torch.Tensor,
                 topk: int, num_groups=None, group_topk=None, default=None):
    """The router's own top-k, with the rows `given` names (ids ≥ 0) replaced by them; the
    scores gathered at the result, as megatron's REPLAY_FORWARD gathers them (at the
    router's own choice that is exactly its top-k values)."""
    probs, idx = default(scores, topk, num_groups=num_groups, group_topk=group_topk)
    if given is not None:
        if given.shape[0] != scores.shape[0]:
            raise ValueError(f"guided routing: {given.shape[0]} rows given, MoE layer {layer} "
                             f"routes {scores.shape[0]}")
        given = given.to(idx.device, non_blocking=True)
        # why no `if any row is given`: that test would wait for the device
        idx = torch.where(given[:, :1] >= 0, given.long(), idx)
        probs = scores.gather(1, idx)
    used[layer] = idx.detach()
    return probs, idx


@contextmanager
def guided_routing(model: torch.nn.Module, given: torch.Tensor | None) -> Iterator[dict]:
    """Within the block, MoE layer l routes row t to `given[t, l, :]` where that row holds
    expert ids (≥ 0) and to its own top-k where it holds −1 (`given` None: every row its
    own). The dict yielded maps each MoE layer that ran to the [rows, topk] ids it used
    (the last forward's), so one call both replays known rows and records the rest.

    Rows per layer are all given or all free in practice (a position's record covers the
    layers its forward ran); the test is on the first top-k slot."""
    replays = model_replays(model)
    if given is not None and (given.dim() != 3 or given.shape[1] != len(replays)):
        raise ValueError(f"guided routing: expected [tokens, {len(replays)} MoE layers, topk], "
                         f"got shape {tuple(given.shape)}")
    used: dict = {}
    for layer, r in enumerate(replays):
        r.get_replay_topk = partial(_guided_topk, None if given is None else given[:, layer],
                                    used, layer)
    try:
        yield used
    finally:
        for r in replays:
            del r.get_replay_topk  # back to the class's method
