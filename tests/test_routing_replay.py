"""Routing replay on a Megatron-Core `TopKRouter` (tsync_mcore.model.routing_replay).

The reference is the HF Qwen3-MoE router math written out in FP64 (softmax over all
experts, keep the chosen ones, renormalise when norm_topk_prob): forcing experts must give
exactly those experts and HF's weights for them (to FP32: megatron's top-k softmax is FP32
even with moe_router_dtype fp64); recording must give the router's own top-k. Full-model replay (logits follow forced experts) needs the MoE bridge.
"""

from __future__ import annotations

import pytest
import torch

E, K, H, T = 6, 2, 16, 7


@pytest.fixture(scope="module")
def routers(parallel1):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron 0.16.1 reads this TE name unguarded without Transformer Engine (the MoE
    # bridge sets it when it builds a model)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    out = {}
    for norm_topk in (True, False):
        cfg = TransformerConfig(
            num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
            moe_router_topk=K, moe_router_score_function="softmax",
            moe_router_pre_softmax=not norm_topk, moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0, moe_enable_routing_replay=True, moe_router_dtype="fp64",
            params_dtype=torch.float64, add_bias_linear=False)
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(0)
        layers = torch.nn.ModuleList([TopKRouter(config=cfg, pg_collection=pgs)
                                      for _ in range(2)])
        with torch.no_grad():
            for r in layers:
                r.weight.normal_(0.0, 1.0)
        out[norm_topk] = layers
    return out


def run(layers, x):
    """Each router on the same tokens (a stand-in for two MoE layers); [T, E] maps."""
    return [r(x.view(T, 1, H)) for r in layers]


def hf_weights(weight, x, experts, norm_topk: bool):
    """HF Qwen3MoeTopKRouter's routing weights, FP64, with the experts given instead of
    its own top-k; dense [T, E] (0 where not routed)."""
    p = torch.softmax((x @ weight.T).double(), dim=-1)
    w = p.gather(1, experts)
    if norm_topk:
        w = w / w.sum(-1, keepdim=True)
    return torch.zeros(T, E, dtype=torch.float64).scatter(1, experts, w)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_forced_routing_follows_given_experts(routers, norm_topk):
    from tsync_mcore.model.routing_replay import forced_routing

    layers = routers[norm_topk]
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    own = [torch.topk(x @ r.weight.T, K, dim=-1).indices for r in layers]
    # the lowest-scoring experts: never the router's own choice
    forced = torch.stack([torch.topk(x @ r.weight.T, K, dim=-1, largest=False).indices
                          for r in layers], dim=1)  # [T, layers, K]
    assert not any(bool((forced[:, i].sort(-1).values == o.sort(-1).values).all(-1).any())
                   for i, o in enumerate(own))
    with forced_routing(layers, forced):
        got = run(layers, x)
    for i, (r, (probs, rmap)) in enumerate(zip(layers, got)):
        want = torch.zeros(T, E, dtype=torch.bool).scatter(1, forced[:, i], True)
        assert torch.equal(rmap, want)
        ref = hf_weights(r.weight.detach(), x, forced[:, i], norm_topk)
        # megatron takes the top-k softmax in FP32 whatever moe_router_dtype says
        assert (probs.double() - ref).abs().max() < 1e-6
    # outside the block the routers choose again
    for (probs, rmap), o in zip(run(layers, x), own):
        assert torch.equal(rmap, torch.zeros(T, E, dtype=torch.bool).scatter(1, o, True))


def test_recorded_routing_is_own_topk(routers):
    from tsync_mcore.model.routing_replay import forced_routing, recorded_routing

    layers = routers[True]
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with recorded_routing(layers) as rec:
        first = run(layers, x)
    experts = rec["experts"]
    assert experts.shape == (T, 2, K) and experts.dtype == torch.int64
    for i, r in enumerate(layers):
        own = torch.topk(x @ r.weight.T, K, dim=-1).indices
        assert torch.equal(experts[:, i].sort(-1).values, own.sort(-1).values)
    # replaying the record reproduces the forward bit for bit (learner mode: the first
    # forward under θ_k is the record for every later one)
    with forced_routing(layers, experts):
        again = run(layers, x)
    for (p0, m0), (p1, m1) in zip(first, again):
        assert torch.equal(m0, m1) and torch.equal(p0, p1)


def test_forced_routing_checks_shape(routers):
    from tsync_mcore.model.routing_replay import forced_routing

    layers = routers[True]
    with pytest.raises(ValueError, match="expected experts"):
        with forced_routing(layers, torch.zeros(T, 3, K, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="integers"):
        with forced_routing(layers, torch.zeros(T, 2, K)):
            pass
