"""Routing replay on Megatron-Core MoE routers (tsync_mcore.model.routing_replay).

The reference is the HF Qwen3-MoE router math written out in FP64 (softmax over all
experts, keep the chosen ones, renormalise when norm_topk_prob): forcing experts must give
exactly those experts and HF's weights for them (to FP32: megatron's top-k softmax is FP32
even with moe_router_dtype fp64); recording must give the router's own top-k. A whole
Megatron MoE layer under forced routing matches the HF block under forced routing, forward
and gradients. Full-model replay (logits follow forced experts) needs the MoE bridge.
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


# ------------------------------------------------------------ HF reference: forced routing

@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tsync_mcore.model.tiny import make_tiny_checkpoint

    d = make_tiny_checkpoint(str(tmp_path_factory.mktemp("hf_moe")), arch="qwen3_moe",
                             vocab_size=300, hidden=2 * H, heads=2, kv_heads=1, layers=2,
                             experts=E, top_k=K, seed=3, router_std=0.5)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64,
                                                experts_implementation="eager").eval()


def test_hf_forced_routing_matches_hand_written_moe(hf_moe):
    """The reference the learner's replay will be checked against: forcing HF's routing
    reproduces its own forward bit for bit; forcing other experts gives, in each MoE
    block, exactly sum_k w_k down_e(silu(gate_e h) * up_e h) over the forced experts."""
    from tsync_mcore.model.tiny_moe import hf_forced_routing, hf_recorded_routing

    ids = torch.tensor([[1, 87, 85, 260, 201, 5, 6, 7, 8]])
    with torch.no_grad(), hf_recorded_routing(hf_moe) as rec:
        own = hf_moe(input_ids=ids).logits
    experts = rec["experts"]
    assert experts.shape == (ids.numel(), 2, 2)
    with torch.no_grad(), hf_forced_routing(hf_moe, experts):
        assert torch.equal(hf_moe(input_ids=ids).logits, own)

    # the two experts each row did not pick, lowest-index first
    other = torch.stack([torch.stack([torch.tensor(
        [e for e in range(6) if e not in row.tolist()][:2]) for row in experts[:, layer]])
        for layer in range(2)], dim=1)
    seen: dict[int, tuple] = {}
    hooks = [layer.mlp.register_forward_hook(
        lambda _m, inp, out, i=i: seen.__setitem__(i, (inp[0][0], out[0])))
        for i, layer in enumerate(hf_moe.model.layers)]
    try:
        with torch.no_grad(), hf_forced_routing(hf_moe, other):
            forced = hf_moe(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    assert (forced - own).abs().max() > 1e-3
    for i, layer in enumerate(hf_moe.model.layers):
        h, out = seen[i]
        mlp = layer.mlp
        inter = mlp.experts.down_proj.shape[-1]
        p = torch.softmax(h @ mlp.gate.weight.T, dim=-1)
        want = torch.zeros_like(out)
        for t in range(h.shape[0]):
            es = other[t, i]
            w = p[t, es] / p[t, es].sum()
            for k, e in enumerate(es.tolist()):
                gu = mlp.experts.gate_up_proj[e]
                a = torch.nn.functional.silu(gu[:inter] @ h[t]) * (gu[inter:] @ h[t])
                want[t] += w[k] * (mlp.experts.down_proj[e] @ a)
        # HF takes the router softmax in FP32 (dtype=torch.float) even in an FP64 model
        assert (out - want).abs().max() < 1e-7


def megatron_moe_layer(block, config_kw: dict):
    """A Megatron MoELayer (router + SequentialMLP experts, local linears) holding an HF
    Qwen3MoeSparseMoeBlock's weights: router = gate.weight, expert e's fc1 = gate_up_proj[e]
    ([gate; up], Megatron's swiglu order), fc2 = down_proj[e]."""
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    n_exp, inter, hidden = block.experts.down_proj.shape[0], block.experts.down_proj.shape[2], \
        block.experts.down_proj.shape[1]
    cfg = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=n_exp,
        moe_ffn_hidden_size=inter, ffn_hidden_size=inter, moe_router_topk=block.gate.top_k,
        moe_router_score_function="softmax", moe_router_pre_softmax=not block.gate.norm_topk_prob,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_enable_routing_replay=True, params_dtype=torch.float64, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, moe_grouped_gemm=False,
        # allgather: the alltoall dispatcher needs a CUDA stream (the bridge patches it on CPU)
        moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=None, **config_kw)
    spec = MoESubmodules(experts=ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    layer = MoELayer(config=cfg, submodules=spec, layer_number=1,
                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        for e, mlp in enumerate(layer.experts.local_experts):
            mlp.linear_fc1.weight.copy_(block.experts.gate_up_proj[e])
            mlp.linear_fc2.weight.copy_(block.experts.down_proj[e])
    return layer


def test_megatron_moe_layer_follows_forced_experts_like_hf(hf_moe, parallel1):
    """A whole Megatron MoE layer under `forced_routing` against the HF block under
    `hf_forced_routing`, same weights, experts the router would not pick: outputs and the
    gradients of the input, the router and the experts agree (to the FP32 of both sides'
    top-k softmax)."""
    from tsync_mcore.model.routing_replay import forced_routing
    from tsync_mcore.model.tiny_moe import hf_forced_routing

    block = hf_moe.model.layers[0].mlp
    layer = megatron_moe_layer(block, {})
    x = torch.randn(T, H * 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    own = torch.topk(x @ block.gate.weight.T, K, dim=-1).indices
    forced = torch.topk(x @ block.gate.weight.T, K, dim=-1, largest=False).indices
    assert not bool((own.sort(-1).values == forced.sort(-1).values).all(-1).any())

    xm, xh = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with forced_routing(torch.nn.ModuleList([layer]), forced[:, None, :]):
        out_m = layer(xm.view(T, 1, -1))[0].view(T, -1)
        out_m.pow(2).sum().backward()
    block.zero_grad()
    with hf_forced_routing(hf_moe, torch.stack([forced, forced], dim=1)):
        out_h = block(xh.view(1, T, -1)).view(T, -1)
        out_h.pow(2).sum().backward()
    assert (out_m - out_h).abs().max() < 1e-7
    assert (xm.grad - xh.grad).abs().max() < 1e-6
    assert (layer.router.weight.grad - block.gate.weight.grad).abs().max() < 1e-6
    for e, mlp in enumerate(layer.experts.local_experts):
        assert (mlp.linear_fc1.weight.grad - block.experts.gate_up_proj.grad[e]).abs().max() < 1e-6
        assert (mlp.linear_fc2.weight.grad - block.experts.down_proj.grad[e]).abs().max() < 1e-6
    # experts outside the forced set get no gradient on either side
    unused = sorted(set(range(E)) - set(forced.flatten().tolist()))
    for e in unused:
        assert layer.experts.local_experts[e].linear_fc1.weight.grad is None \
            or not layer.experts.local_experts[e].linear_fc1.weight.grad.any()


# --------------------------------------------------------------------------- the learner's routing


@pytest.fixture(scope="module")
def moe_policy(parallel1, tiny_qwen3_moe):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy

    cfg = load_config(None, {"model.hf_dir": tiny_qwen3_moe, "learner.routing_replay": "rollout"},
                      replay=True)
    return Policy(cfg, par=parallel1)


def test_policy_logprobs_follow_forced_experts(moe_policy, tiny_qwen3_moe):
    """The whole Megatron model under guided routing — rows given are forced to experts its
    routers would not pick, the last rows route themselves — gives the HF model's
    log-probs under the same routing (hf_forced_routing), FP32 ≤ 1e-5; far from its own."""
    from tests.helpers.moe_reference import load_hf_moe
    from tsync_mcore.model import bridge
    from tsync_mcore.model.routing_replay import guided_routing
    from tsync_mcore.model.tiny_moe import hf_forced_routing, hf_recorded_routing

    n, free = 20, 3
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7))
    hf = load_hf_moe(tiny_qwen3_moe)
    with torch.no_grad(), hf_recorded_routing(hf) as rec:
        own_logp = torch.log_softmax(hf(ids[None]).logits[0].double(), -1)
    own = rec["experts"]  # [n, layers, 2] of 4 experts: the other two are never its choice
    others = torch.stack([torch.tensor([e for e in range(4) if e not in row])
                          for row in own.reshape(-1, 2).tolist()]).view_as(own)
    given = others.clone()
    given[n - free:] = -1
    want = torch.where(given >= 0, given, own)  # what each row must be routed to
    with torch.no_grad(), hf_forced_routing(hf, want):
        want_logp = torch.log_softmax(hf(ids[None]).logits[0].double(), -1)
    with torch.no_grad(), guided_routing(moe_policy.model, given) as used:
        got = bridge.logits(moe_policy.ddp, ids[None])[0]
    got_logp = torch.log_softmax(got.double(), -1)
    err = float((got_logp - want_logp).abs().max())
    print(f"forced routing: Megatron vs HF log-probs max |err| = {err:.2e}; vs own routing "
          f"{float((got_logp - own_logp).abs().max()):.2e}")
    assert err <= 1e-5
    assert float((got_logp - own_logp).abs().max()) > 1e-2  # the forced experts mattered
    used = torch.stack([used[layer] for layer in sorted(used)], dim=1)
    assert torch.equal(used.sort(-1).values, want.sort(-1).values)


def _traj(routed=None, n=8, **kw):
    from tsync_mcore.channel.sources import TrajectorySource

    return TrajectorySource("t", "g", tuple(range(1, n + 1)), (0,) * 4 + (1,) * (n - 4), 1.0, 0,
                            routed_experts=routed, **kw)


def test_rollout_routing_is_checked_against_the_model(moe_policy):
    """learner.routing_replay=rollout: a source without routed experts, or with the wrong
    layers, top-k, rows, expert ids or a repeated expert, is refused naming it."""
    import numpy as np

    from tsync_mcore.channel.sources import RoutedExperts, SourceError
    from tsync_mcore.learner.serving.experts import ExpertRoutes

    routes = ExpertRoutes("rollout", moe_policy)
    good = np.array([[[0, 1], [2, 3]]] * 7)  # 8 tokens: 7 rows
    routes.check("src", _traj(RoutedExperts.from_array(good)))
    bad = {
        "no routed_experts": None,
        "1 layers × top-2, the model routes 2 MoE layers × top-2": good[:, :1],
        "has 6 rows, expected 7": good[:6],
        "routed expert id 4 out of range: the model has 4 experts": good + 1,
        "names an expert twice": np.array([[[1, 1], [2, 3]]] * 7),
    }
    for why, arr in bad.items():
        with pytest.raises(SourceError, match=f"src: .*{why}"):
            routes.check("src", _traj(None if arr is None else RoutedExperts.from_array(arr)))
    ExpertRoutes("off", moe_policy).check("src", _traj())  # other modes ignore it


def test_learner_mode_books_the_first_forward(moe_policy):
    """learner.routing_replay=learner: a forward books what it used; a later forward over
    booked positions replays them (here: bit for bit the same logits as the first pass),
    and new positions are booked as they first run."""
    from tsync_mcore.learner.serving.experts import ExpertRoutes
    from tsync_mcore.model import bridge
    from tsync_mcore.model.routing_replay import guided_routing

    routes = ExpertRoutes("learner", moe_policy)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), routes.forward([("a", 0, 12)]):
        first = bridge.logits(moe_policy.ddp, ids[None])[0]
    booked = routes.book["a"].clone()
    assert booked.shape == (12, 2, 2) and bool((booked >= 0).all())
    # the same positions again, now forced through the book; other trajectories untouched
    with torch.no_grad(), routes.forward([("a", 0, 12)]):
        again = bridge.logits(moe_policy.ddp, ids[None])[0]
    assert torch.equal(first, again) and torch.equal(routes.book["a"], booked)
    # a book entry is what the model routed: its own top-k
    with torch.no_grad(), guided_routing(moe_policy.model, None) as own:
        bridge.logits(moe_policy.ddp, ids[None])
    assert torch.equal(torch.stack([own[0], own[1]], 1).sort(-1).values.to(torch.int16),
                       booked.sort(-1).values)
    assert routes.agree("a", "b", 5)  # only "rollout" books a prompt before it runs
