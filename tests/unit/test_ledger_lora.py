"""FLOP ledger for LoRA policies: exact against FlopCounterMode on an independent model, the
Hugging Face checkpoint wrapped with `peft` (separate q/k/v modules, FP64); arithmetic of the
adapters' own products and of their TP split."""

from __future__ import annotations

import pytest
import torch

from tsync_mcore.observability.ledger import (
    LoraShape,
    load_spec,
    replay_flops,
    span_flops,
    train_flops,
)
from tsync_mcore.observability.ledger.flops import (
    COMPONENTS,
    LORA_TARGETS,
    TP_REPLICATED,
)
from tsync_mcore.observability.ledger.sizes import (
    accum_bytes,
    adapter_params,
    model_params,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


SUBSETS = {
    "all": LORA_TARGETS,
    "q_v": ("q_proj", "v_proj"),  # k untargeted: its output needs no grad in layer 0 (peft)
    "mlp": ("gate_proj", "down_proj"),  # layer 0's attention gets no backward at all
}


def _peft_model(hf_dir: str, targets: tuple[str, ...], rank: int = 4):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", dtype=torch.float64)  # eager: the S×S scores
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                          lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


def _token_loss(logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tok[..., None]).sum()


@pytest.mark.parametrize("subset", sorted(SUBSETS))
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_lora_train_flops_equal_counter_on_peft(name, subset, tiny_ckpts):
    """GRPO-style dense sequences, one forward each, a token loss, one backward."""
    from torch.utils.flop_counter import FlopCounterMode

    targets, lens = SUBSETS[subset], [7, 23, 64]
    model = _peft_model(tiny_ckpts[name], targets)
    spec = load_spec(tiny_ckpts[name])
    gen = torch.Generator().manual_seed(0)
    with FlopCounterMode(display=False) as fc:
        loss = torch.zeros((), dtype=torch.float64)
        for s in lens:
            tok = torch.randint(0, spec.vocab_size, (1, s), generator=gen)
            loss = loss + _token_loss(model(input_ids=tok).logits, tok)
        fwd = fc.get_total_flops()
        loss.backward()
        total = fc.get_total_flops()
    b = train_flops(spec, lens, lora=LoraShape(4, targets, separate_qkv=True))
    assert (b.forward, b.total) == (fwd, total)
    full = train_flops(spec, lens)
    assert b.forward > full.forward and b.backward < full.backward  # adapters on, base frozen


@pytest.mark.parametrize("subset", ["all", "q_v"])
def test_lora_span_flops_equal_counter_on_peft(subset, tiny_qwen3):
    """An OPD turn: n tokens after P context tokens whose K/V are grad-collecting leaves."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    targets, P, n = SUBSETS[subset], 21, 13
    model = _peft_model(tiny_qwen3, targets)
    spec = load_spec(tiny_qwen3)
    tok = torch.randint(0, spec.vocab_size, (1, P + n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ctx = model(input_ids=tok[:, :P], use_cache=True).past_key_values
    past = DynamicCache()
    for i, layer in enumerate(ctx.layers):
        past.update(layer.keys.detach().requires_grad_(), layer.values.detach().requires_grad_(), i)
    with FlopCounterMode(display=False) as fc:
        logits = model(input_ids=tok[:, P:], past_key_values=past, use_cache=True).logits
        fwd = fc.get_total_flops()
        _token_loss(logits, tok[:, P:]).backward()
        total = fc.get_total_flops()
    b = span_flops(spec, n, P, lora=LoraShape(4, targets, separate_qkv=True))
    assert (b.forward, b.total) == (fwd, total)


def test_lora_ledger_arithmetic(tiny_qwen3):
    spec = load_spec(tiny_qwen3)
    h, hd, heads, kv, ffn, L = (spec.hidden, spec.head_dim, spec.heads, spec.kv_heads,
                                spec.ffn, spec.layers)  # fmt: skip
    s, r = 50, 8
    full = train_flops(spec, [s])
    lora = train_flops(spec, [s], lora=LoraShape(r))
    assert list(lora.by_component) == [c for c in COMPONENTS if c in lora.by_component]
    base = {k: v for k, v in lora.by_component.items() if ".lora_" not in k}
    assert sum(v["forward"] for v in base.values()) == full.forward  # base forward unchanged
    # adapters: A on T·in -> T·r, B on T·r -> T·out, per targeted projection, every layer
    c = lora.by_component
    assert c["qkv_proj.lora_A"]["forward"] == L * 2 * s * h * r * 3
    assert c["qkv_proj.lora_B"]["forward"] == L * 2 * s * r * (heads + 2 * kv) * hd
    assert c["mlp_down.lora_A"]["forward"] == L * 2 * s * ffn * r
    # layer 0's q/k/v adapters see the frozen embedding: weight-grad only; B always both
    assert c["qkv_proj.lora_A"]["backward"] == c["qkv_proj.lora_A"]["forward"] * (2 * L - 1) // L
    assert all(c[k]["backward"] == 2 * c[k]["forward"] for k in c if k.endswith("lora_B"))
    # frozen base: input-grad only, none into layer 0's QKV
    assert c["qkv_proj"]["backward"] == c["qkv_proj"]["forward"] * (L - 1) // L
    assert lora.total == sum(v["forward"] + v["backward"] for v in c.values())
    # a LoraSpec-like object works the same; frozen and lora together are refused
    like = type("Spec", (), {"rank": r, "targets": list(LORA_TARGETS)})()
    assert train_flops(spec, [s], lora=like).to_dict() == lora.to_dict()
    with pytest.raises(ValueError):
        train_flops(spec, [s], lora=LoraShape(r), frozen=["output_layer.weight"])
    with pytest.raises(ValueError):
        LoraShape(0)
    with pytest.raises(ValueError):
        LoraShape(4, ("qkv",))
    # megatron's fused linear_qkv: a targeted q makes k require grad too (one more QK^T grad)
    qv = LoraShape(r, SUBSETS["q_v"])
    sep = LoraShape(r, SUBSETS["q_v"], separate_qkv=True)
    d = (train_flops(spec, [s], lora=qv).backward - train_flops(spec, [s], lora=sep).backward)
    assert d == 2 * heads * hd * s * s
    # spans and replays carry the adapters; forward-only spans keep their components
    assert span_flops(spec, s, 0, lora=qv).to_dict() == train_flops(spec, [s], lora=qv).to_dict()
    rep = replay_flops(spec, 10, 20, lora=qv)
    assert rep.forward == 0 and rep.by_component["qkv_proj.lora_B"]["backward"] > 0


def test_lora_per_rank_keeps_replicated_adapter_work(tiny_qwen3):
    spec = load_spec(tiny_qwen3)
    b = train_flops(spec, [40, 24], lora=LoraShape(16))
    for tp in (1, 2):
        one = b.per_rank(tp)
        rep = sum(v["forward"] for k, v in b.by_component.items() if k in TP_REPLICATED)
        assert one.forward == (b.forward - rep) // tp + rep
        assert one.forward == sum(v["forward"] for v in one.by_component.values())
        assert one.backward == sum(v["backward"] for v in one.by_component.values())
    # the TP group executes more than the model FLOPs: the replicated adapter products
    assert b.per_rank(2).total * 2 > b.total
    assert train_flops(spec, [40]).per_rank(2).total * 2 == train_flops(spec, [40]).total


MEGATRON_CASES = [("qwen3", "all", True), ("qwen2", "q_v", False), ("qwen3_tied", "mlp", True)]


@pytest.mark.parametrize("name,subset,fused", MEGATRON_CASES)
def test_lora_policy_source_equal_counter(name, subset, fused, tiny_ckpts, parallel1):
    """One source served by a LoRA Policy (model/lora.py adapters on the fused linears) under
    FlopCounterMode, against the ledger's account of its trace record with `policy.lora`."""
    from torch.utils.flop_counter import FlopCounterMode

    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.observability.ledger.account import update_flops
    from tsync_mcore.observability.trace import SourceRecord

    cfg = load_config(None, {"model.hf_dir": tiny_ckpts[name], "learner.fused_lm_head": fused,
                             "model.lora.rank": 4, "model.lora.targets": list(SUBSETS[subset])})
    policy = Policy(cfg, par=parallel1)
    assert policy.lora is not None and policy.lora.targets == SUBSETS[subset]
    tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    mask = [0] * 10 + [1] * 12 + [0] * 8
    with FlopCounterMode(display=False) as fc:
        policy.backward_source(tokens, mask, 1.0)
    policy.zero_grads()
    rec = SourceRecord(update=0, rank=0, source="trajectory", traj_id="t", group_id="g",
                       turn=None, policy_version=0, scored_tokens=12, ready=0.0,
                       start=0.0, end=1.0, span_tokens=30, logits=True, fused_head=fused)
    work = update_flops(policy.spec, [rec], attention=policy.attention_mode, lora=policy.lora)
    assert work.total + work.recompute_flops == fc.get_total_flops()
    assert work.by_component["qkv_proj" if subset != "mlp" else "mlp_down"] ["forward"] > 0
    assert any(k.endswith(".lora_B") for k in work.by_component)


def test_lora_span_and_replay_equal_counter(tiny_qwen3, parallel1):
    """An OPD turn against context K/V leaves and its deferred replay, LoRA on q and v only
    (megatron's fused linear_qkv: k requires grad with them)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from torch.utils.flop_counter import FlopCounterMode

    from tsync_mcore.model import bridge, lora, span

    model, spec = bridge.build_model(tiny_qwen3)
    spec_l = lora.LoraSpec(4, 8.0, SUBSETS["q_v"])
    lora.attach(model, spec, spec_l, seed=0)
    P, n = 21, 13
    toks = torch.randint(0, spec.vocab_size, (P + n,), generator=torch.Generator().manual_seed(3))
    _, kv0 = span.span_forward(model, toks[:P], 0, None, want_logits=False)
    past = span.detached_leaves(kv0)
    with FlopCounterMode(display=False) as fc:
        lg, _ = span.span_forward(model, toks[P:], P, past)
        fwd = fc.get_total_flops()
        vocab_parallel_cross_entropy(lg.float()[None], toks[P:][None]).sum().backward()
    b = span_flops(spec, n, P, lora=spec_l)
    assert (b.forward, b.total) == (fwd, fc.get_total_flops())
    with FlopCounterMode(display=False) as fc:
        _, kv = span.span_forward(model, toks[P:], P, past, stop_after_kv=True)
        rec = fc.get_total_flops()
        span.backward_kv(kv, [(torch.randn_like(x.k), torch.randn_like(x.v)) for x in kv])
    r = replay_flops(spec, n, P, lora=spec_l)
    assert (r.recompute_flops, r.backward) == (rec, fc.get_total_flops() - rec)


def test_lora_update_flops_and_accumulator_size(tiny_qwen2, parallel1):
    """One GRPO update of a LoRA learner (shared prompts and packed passes as configured):
    FlopCounterMode over the whole update equals the ledger's account of its trace, and the
    accumulators are sized to the adapters: P_A elements, bound 4·(2k+1)·P_A bytes."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.helpers.batchgen import make_batch
    from tsync_mcore.channel.sources import BatchPlan, TrajectorySource
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    from tsync_mcore.observability.ledger.account import update_flops

    cfg = load_config(None, {"model.hf_dir": tiny_qwen2, "model.lora.rank": 4,
                             "learner.schedule": "thundersync", "learner.k_open": 2})
    policy = Policy(cfg, par=parallel1)
    learner = Learner(cfg.learner, policy)
    rows = sorted(make_batch(256, n_groups=3, m=3, seed=5), key=lambda r: r["ready_order"])
    srcs = [TrajectorySource.from_json({k: v for k, v in r.items() if k != "update"})
            for r in rows]
    with FlopCounterMode(display=False) as fc:
        learner.begin(BatchPlan.from_sources(srcs))
        for s in srcs:
            learner.submit(s)
        result = learner.close()
    work = update_flops(policy.spec, result.trace, attention=policy.attention_mode,
                        lora=policy.lora)
    assert work.total + work.recompute_flops == fc.get_total_flops()
    u = result.summary
    p_a = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    p_all = sum(p.numel() for p in policy.model.parameters())
    assert u.accum_params == p_a == adapter_params(policy.spec, 4) and 0 < p_a < p_all // 10
    assert p_all == model_params(policy.spec) + p_a
    assert u.accum_bound_bytes == 4 * (2 * 2 + 1) * p_a == accum_bytes(p_a, 2)
    assert u.accum_peak_bytes <= u.accum_bound_bytes


def test_ledger_cli_lora(tiny_qwen3, capsys):
    import json

    from tsync_mcore.observability.ledger.__main__ import main

    assert main(["--model", tiny_qwen3, "--seq-lens", "16,40", "--lora-rank", "8",
                 "--lora-targets", "q_proj,v_proj", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = train_flops(load_spec(tiny_qwen3), [16, 40], lora=LoraShape(8, ("q_proj", "v_proj")))
    assert got["total_flops"] == want.total and got["lora"]["rank"] == 8
    assert main(["--model", tiny_qwen3, "--seq-lens", "16", "--lora-rank", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: LoRA rank must be >= 1")


def test_sizes_tool(tiny_ckpts, capsys):
    import json

    from tsync_mcore.model import lora
    from tsync_mcore.observability.ledger.sizes import main, preset_spec

    # P against the Hugging Face model, P_A against model/lora.py's count and peft's
    for name in ("qwen2", "qwen3_tied"):
        spec = load_spec(tiny_ckpts[name])
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpts[name])
        assert model_params(spec) == sum(p.numel() for p in hf.parameters())
        for targets in SUBSETS.values():
            got = adapter_params(spec, 8, targets)
            assert got == lora.n_adapter_params(spec, lora.LoraSpec(8, 16.0, targets))
            pm = peft.get_peft_model(hf, peft.LoraConfig(r=8, target_modules=list(targets)))
            assert got == sum(p.numel() for p in pm.parameters() if p.requires_grad)
            hf = pm.unload()
    # the 8B shapes: Qwen3-8B has 8.19B parameters; rank 16 on every linear about 0.5 %
    q8 = preset_spec("qwen3-8b")
    assert round(model_params(q8) / 1e9, 2) == 8.19
    assert adapter_params(q8, 16) == 36 * 16 * (3 * 4096 + 4096 + 1024 * 2 + 4096 * 2
                                                 + 3 * (4096 + 12288))
    assert main(["--preset", "qwen3-8b", "--ranks", "16,64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["rank"] for r in out["rows"]] == [0, 16, 64]
    assert out["rows"][1]["accum_grpo_bytes"] == 4 * 9 * adapter_params(q8, 16)
    assert main(["--preset", "demo", "--ranks", "8"]) == 0
    assert "LoRA r=8 (P_A)" in capsys.readouterr().out
    for bad in (["--model", "/nonexistent"], ["--preset", "demo", "--targets", "qkv"]):
        assert main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error:"), err
