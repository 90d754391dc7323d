"""FLOP ledger for mixture-of-experts layers: exact against FlopCounterMode on an independent
model, Hugging Face `Qwen3MoeForCausalLM` (eager attention, eager experts loop, FP64), with the
routing recorded from that forward by `RoutingCounter`; arithmetic and refusals of the MoE
parts; the counter on Megatron-Core's own TopKRouter."""

from __future__ import annotations

import json

import pytest
import torch

from tsync_mcore.observability.ledger import (
    MoeShape,
    RoutingCounter,
    load_moe,
    span_flops,
    train_flops,
)
from tsync_mcore.observability.ledger.flops import COMPONENTS, TP_REPLICATED
from tsync_mcore.util.safe_files import ModelDirError

transformers = pytest.importorskip("transformers")


# Layer 1 is a dense MLP (mlp_only_layers), layers 0, 2, 3 are MoE: both kinds in one model.
CFG = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, intermediate_size=40, moe_intermediate_size=24,
           num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
           tie_word_embeddings=False, max_position_embeddings=256)


SEQ_SETS = [[7], [23, 5], [64, 1, 30]]


def _spec():
    """The dense facts as a Qwen3 ModelSpec, the MoE layers passed as `moe=`. why: the
    converter maps all-MoE stacks only; the ledger also counts mixed ones (layer 1 here)."""
    from tsync_mcore.model.bridge import ModelSpec

    return ModelSpec.from_hf_config({**_config().to_dict(), "model_type": "qwen3"})


def _config():
    return transformers.Qwen3MoeConfig(**CFG)


@pytest.fixture(scope="module")
def hf_moe():
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM._from_config(
        _config(), attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float64)  # eager: the S×S scores; eager experts: one mm per expert hit
    with torch.no_grad():  # a spread router, so that routing differs from input to input
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    return model


def _token_loss(logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tok[..., None]).sum()


def _fwd_bwd(model, lens: list[int], seed: int) -> tuple[int, int, list[list[int]]]:
    """One forward per sequence, a token loss, one backward: counted FLOPs and the routing."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with RoutingCounter(model) as rc, FlopCounterMode(display=False) as fc:
        loss = torch.zeros((), dtype=torch.float64)
        for s in lens:
            tok = torch.randint(0, CFG["vocab_size"], (1, s), generator=gen)
            loss = loss + _token_loss(model(input_ids=tok).logits, tok)
        fwd = fc.get_total_flops()
        loss.backward()
        total = fc.get_total_flops()
    return fwd, total, rc.counts()


@pytest.mark.parametrize("lens", SEQ_SETS, ids=str)
def test_moe_train_flops_equal_counter(lens, hf_moe):
    spec, moe = _spec(), MoeShape.from_hf_config(_config().to_dict())
    assert moe.layers == (0, 2, 3)
    fwd, total, routing = _fwd_bwd(hf_moe, lens, seed=len(lens))
    assert [sum(r) for r in routing] == [2 * sum(lens)] * 3  # top-2 of every token
    b = train_flops(spec, lens, moe=moe, routing=routing)
    assert (b.forward, b.total) == (fwd, total)
    assert b.by_component["router"]["forward"] == 3 * 2 * sum(lens) * 32 * 6
    # routed-token counts decide where expert FLOPs run, not how many: k·T in all
    assert train_flops(spec, lens, moe=moe).to_dict() == b.to_dict()


def test_moe_routing_follows_the_input(hf_moe):
    """Different inputs route differently; an uneven routing is still counted exactly."""
    runs = [_fwd_bwd(hf_moe, [24], seed=s) for s in (1, 2)]
    assert runs[0][2] != runs[1][2]
    assert any(max(row) - min(row) >= 4 for row in runs[0][2])  # not an even spread
    spec, moe = _spec(), MoeShape.from_hf_config(_config().to_dict())
    for fwd, total, routing in runs:
        b = train_flops(spec, [24], moe=moe, routing=routing)
        assert (b.forward, b.total) == (fwd, total)


@pytest.mark.parametrize("frozen", ["experts", "router"])
def test_moe_frozen_parts_vs_counter(frozen, hf_moe):
    """Frozen experts: input-grad only (both models). A frozen router: autograd (HF) skips its
    weight-grad, Megatron's RouterGatingLinearFunction computes it anyway — the ledger counts
    Megatron, so it is above the HF counter by exactly the routers' forward FLOPs."""
    hf_part = {"experts": ".mlp.experts.", "router": ".mlp.gate."}[frozen]
    mc_part = {"experts": ".mlp.experts.", "router": ".mlp.router."}[frozen]
    params = [p for n, p in hf_moe.named_parameters() if hf_part in n]
    assert params
    for p in params:
        p.requires_grad_(False)
    try:
        fwd, total, routing = _fwd_bwd(hf_moe, [23, 5], seed=7)
    finally:
        for p in params:
            p.requires_grad_(True)
    spec, moe = _spec(), MoeShape.from_hf_config(_config().to_dict())
    b = train_flops(spec, [23, 5], moe=moe, routing=routing, frozen=lambda n: mc_part in n)
    assert b.forward == fwd
    extra = b.by_component["router"]["forward"] if frozen == "router" else 0
    assert b.total - extra == total
    full = train_flops(spec, [23, 5], moe=moe, routing=routing)
    assert b.backward < full.backward or frozen == "router"


def test_moe_span_flops_equal_counter(hf_moe):
    """An OPD turn: n tokens after P context tokens whose K/V are grad-collecting leaves; the
    routing is the span's own (its n tokens only)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    P, n = 21, 13
    gen = torch.Generator().manual_seed(3)
    tok = torch.randint(0, CFG["vocab_size"], (1, P + n), generator=gen)
    with torch.no_grad():
        ctx = hf_moe(input_ids=tok[:, :P], use_cache=True).past_key_values
    past = DynamicCache()
    for i, layer in enumerate(ctx.layers):
        past.update(layer.keys.detach().requires_grad_(), layer.values.detach().requires_grad_(), i)
    hf_moe.zero_grad(set_to_none=True)
    with RoutingCounter(hf_moe) as rc, FlopCounterMode(display=False) as fc:
        logits = hf_moe(input_ids=tok[:, P:], past_key_values=past, use_cache=True).logits
        fwd = fc.get_total_flops()
        _token_loss(logits, tok[:, P:]).backward()
        total = fc.get_total_flops()
    routing = rc.counts()
    assert [sum(r) for r in routing] == [2 * n] * 3
    b = span_flops(_spec(), n, P, moe=MoeShape.from_hf_config(_config().to_dict()),
                   routing=routing)
    assert (b.forward, b.total) == (fwd, total)


def test_moe_ledger_arithmetic():
    spec = _spec()
    moe = MoeShape(experts=6, top_k=2, ffn=24, layers=(0, 2, 3))
    h, T = spec.hidden, 10
    routing = [[20, 0, 0, 0, 0, 0], [4, 4, 4, 4, 2, 2], [0, 0, 0, 0, 0, 20]]
    b = train_flops(spec, [T], moe=moe, routing=routing)
    c = b.by_component
    assert list(c) == [k for k in COMPONENTS if k in c]
    assert c["expert_gate"]["forward"] == c["expert_up"]["forward"] == 3 * 2 * 2 * T * h * 24
    assert c["expert_down"]["forward"] == 3 * 2 * 2 * T * 24 * h
    assert c["mlp_gate"]["forward"] == 2 * T * h * spec.ffn  # layer 1 only: dense
    dense = train_flops(spec, [T])  # the same shapes with every layer dense
    moe_free = {k: v for k, v in c.items() if not k.startswith(("router", "expert", "mlp_"))}
    assert moe_free == {k: v for k, v in dense.by_component.items() if not k.startswith("mlp_")}
    # TP: experts split, the router whole on every rank
    assert "router" in TP_REPLICATED
    r2 = b.per_rank(2)
    assert r2.by_component["router"] == c["router"]
    assert r2.total == (b.total - sum(c["router"].values())) // 2 + sum(c["router"].values())
    # per-expert freezing: an expert's own names (sequential or TE grouped spelling)
    frozen_e0 = ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                 "decoder.layers.0.mlp.experts.linear_fc2.weight0"]
    f0 = train_flops(spec, [T], moe=moe, routing=routing, frozen=frozen_e0)
    # expert 0 of layer 0 took all 20 tokens: its fc1 and fc2 weight-grads are gone
    assert b.backward - f0.backward == 2 * T * 2 * h * 24 * 2 + 2 * T * 2 * 24 * h
    with pytest.raises(ValueError, match="some experts frozen"):
        train_flops(spec, [T], moe=moe, frozen=frozen_e0)  # needs the per-expert counts
    # stop_after_kv: the last layer's MoE does not run, so no row for it
    assert span_flops(spec, T, 5, moe=moe, routing=routing[:2], logits_positions=0).forward > 0
    # attention-only LoRA: router and experts frozen (router: both grads, Megatron)
    lo = train_flops(spec, [T], moe=moe, routing=routing, lora=_Lora(4, ("q_proj", "o_proj")))
    assert lo.by_component["router"]["backward"] == 2 * lo.by_component["router"]["forward"]
    assert lo.by_component["expert_up"]["backward"] == lo.by_component["expert_up"]["forward"]


class _Lora:
    def __init__(self, rank, targets):
        self.rank, self.targets = rank, targets


def test_moe_ledger_refusals(tmp_path):
    spec = _spec()
    moe = MoeShape(6, 2, 24, (0, 2, 3))
    ok = [[4, 4, 4, 4, 2, 2]] * 3
    bad = {
        "rows": (ok[:2], "has 2 rows"),
        "width": ([[10, 10]] * 3, "6 non-negative int"),
        "sum": ([[4, 4, 4, 4, 2, 3]] * 3, "dispatches 21 tokens"),
        "negative": ([[24, -4, 0, 0, 0, 0]] * 3, "non-negative"),
    }
    for name, (routing, msg) in bad.items():
        with pytest.raises(ValueError, match=msg):
            train_flops(spec, [10], moe=moe, routing=routing)
    with pytest.raises(ValueError, match="without MoE"):
        train_flops(spec, [10], routing=ok)
    with pytest.raises(ValueError, match="LoRA on MoE"):
        train_flops(spec, [10], moe=moe, lora=_Lora(4, ("gate_proj",)))
    with pytest.raises(ValueError, match="beyond"):
        train_flops(spec, [10], moe=MoeShape(6, 2, 24, (4,)))
    with pytest.raises(ValueError):
        MoeShape(4, 5, 24, (0,))
    # config.json: sparse step / dense layers, both spellings of the expert count, bad keys
    d = {**_config().to_dict(), "num_hidden_layers": 6, "decoder_sparse_step": 2,
         "mlp_only_layers": [3]}
    assert MoeShape.from_hf_config(d).layers == (1, 5)
    d.pop("num_local_experts", None)
    assert MoeShape.from_hf_config({**d, "num_experts": 6}).experts == 6
    assert MoeShape.from_hf_config({"num_hidden_layers": 2}) is None  # dense
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4, "num_hidden_layers": 2}))
    with pytest.raises(ModelDirError, match="config.json: MoE keys") as e:
        load_moe(str(tmp_path))
    assert "\n" not in str(e.value)
    _config().save_pretrained(tmp_path)
    assert load_moe(str(tmp_path)) == MoeShape(6, 2, 24, (0, 2, 3))


@pytest.fixture(scope="module")
def mcore_moe(parallel1, tiny_qwen3_moe):
    from tsync_mcore.model import bridge

    return bridge.build_model(tiny_qwen3_moe)


@pytest.mark.parametrize("frozen", ["none", "router", "experts"])
def test_moe_ledger_equals_counter_on_megatron(frozen, mcore_moe):
    """The same ledger call on the Megatron model, routing recorded from `mlp.router`
    (TopKRouter's routing_map). A frozen router still runs both grads here."""
    from torch.utils.flop_counter import FlopCounterMode

    from tsync_mcore.model import bridge
    from tsync_mcore.observability.ledger import frozen_names

    model, spec = mcore_moe
    part = {"none": None, "router": ".mlp.router.", "experts": ".mlp.experts."}[frozen]
    params = [p for n, p in model.named_parameters() if part and part in n]
    for p in params:
        p.requires_grad_(False)
    try:
        tokens = torch.randint(0, spec.vocab_size, (2, 19),
                               generator=torch.Generator().manual_seed(len(params)))
        model.zero_grad(set_to_none=True)
        with RoutingCounter(model) as rc, FlopCounterMode(display=False) as fc:
            out = bridge.logits(model, tokens)
            fwd = fc.get_total_flops()
            out.float().logsumexp(-1).sum().backward()
            total = fc.get_total_flops()
        names = frozen_names(model)
    finally:
        for p in params:
            p.requires_grad_(True)
    routing = rc.counts()
    assert len(routing) == spec.layers and [sum(r) for r in routing] == [2 * 38] * spec.layers
    b = train_flops(spec, [19, 19], routing=routing, frozen=names,
                    attention=bridge.attention_mode(model))  # MoE shape from the spec
    assert (b.forward, b.total) == (fwd, total)
    if frozen == "router":
        c = b.by_component["router"]
        assert c["backward"] == 2 * c["forward"]


def test_cli_on_a_moe_checkpoint(tiny_qwen3_moe, capsys):
    from tsync_mcore.observability.ledger import load_spec
    from tsync_mcore.observability.ledger.__main__ import main as cli_main

    assert cli_main(["--model", tiny_qwen3_moe, "--seq-lens", "16,8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["moe"] == {"experts": 4, "top_k": 2, "expert_ffn": 32}
    assert got["total_flops"] == train_flops(load_spec(tiny_qwen3_moe), [16, 8]).total
    assert cli_main(["--model", tiny_qwen3_moe, "--seq-lens", "16", "--lora-rank", "4"]) == 2
    assert "LoRA on MoE" in capsys.readouterr().err


@pytest.mark.parametrize("fused", [True, False])
def test_update_flops_of_a_moe_source(tiny_qwen3_moe, parallel1, fused):
    """What the trainer reports: `update_flops` of a served source's trace record (no routing
    in the trace: k·T per layer) equals FlopCounterMode over the Policy serving it."""
    from torch.utils.flop_counter import FlopCounterMode

    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.observability.ledger.account import update_flops
    from tsync_mcore.observability.trace import SourceRecord

    policy = Policy(load_config(None, {"model.hf_dir": tiny_qwen3_moe,
                                       "learner.fused_lm_head": fused}), par=parallel1)
    tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    mask = [0] * 10 + [1] * 12 + [0] * 8
    with RoutingCounter(policy.model) as rc, FlopCounterMode(display=False) as fc:
        policy.backward_source(tokens, mask, 1.0)
    rec = SourceRecord(update=0, rank=0, source="trajectory", traj_id="t", group_id="g",
                       turn=None, policy_version=0, scored_tokens=12, ready=0.0, start=0.0,
                       end=1.0, span_tokens=30, logits=True, fused_head=fused)
    work = update_flops(policy.spec, [rec], attention=policy.attention_mode)
    assert work.total + work.recompute_flops == fc.get_total_flops()
    spec = policy.spec
    assert work.by_component["expert_up"]["forward"] == 2 * 2 * 30 * spec.hidden * spec.moe_ffn \
        * spec.layers  # top-2 of 30 tokens, every layer
    head = 12 if fused else None
    exact = train_flops(policy.spec, [30], routing=rc.counts(), attention=policy.attention_mode,
                        logits_positions=head)
    assert exact.total == work.total  # the recorded routing gives the same total
