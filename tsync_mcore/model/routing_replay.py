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
