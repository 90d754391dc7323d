"""LoRA policies against Hugging Face + peft (FP64 references in tests/lora_reference.py).

Adapters are PEFT directories with non-zero A and B, saved by peft itself, on the tiny
checkpoints of tests/conftest.py: every target, PEFT's default subset (q_proj, v_proj), and
an odd mix (k_proj alone in the fused QKV, up_proj alone in fc1).
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.batchgen import make_batch, make_opd_batch
from tests.helpers.lora_reference import (
    chain_rule_grad,
    load_peft_model,
    merge_adapter,
    read_adapter,
    reference_lora_grad,
)
from tests.helpers.lora_shared import (  # noqa: F401  (fixtures)
    ADAPTERS,
    FP32_TOL,
    VOCAB,
    adapters,
    bad_dirs,
    check_merged,
    lora_cfg,
)
from tests.helpers.reference import reference_grad, reference_opd_grad, rel_l2


def test_fixture_adapters_are_peft_dirs_with_nonzero_weights(adapters):
    for name, (hf, ad) in adapters.items():
        cfg, tensors = read_adapter(ad)
        targets = set(ADAPTERS[name][1])
        assert (cfg["r"], cfg["lora_alpha"], set(cfg["target_modules"])) == (4, 8, targets)
        assert not cfg["use_dora"] and cfg["bias"] == "none"
        assert cfg["use_rslora"] == ADAPTERS[name][2]
        assert len(tensors) == 2 * 2 * len(targets)  # 2 layers × (A, B) per target
        assert all(t.abs().max() > 1e-3 for t in tensors.values()), name
        assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    # the adapter moves the logits visibly (else the equivalences below prove little)
    hf, ad = adapters["qwen2_all"]
    tokens = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m = load_peft_model(hf, ad, torch.float32)
        with_adapter = m(input_ids=tokens).logits
        with m.disable_adapter():
            base = m(input_ids=tokens).logits
    assert (with_adapter - base).abs().max() > 0.05


@pytest.mark.parametrize("name,objective", [("qwen2_all", "grpo"), ("qwen3_tied_mix", "grpo"),
                                            ("llama_tied_sub", "opd"), ("qwen3_all", "opd"),
                                            ("llama_rslora", "grpo")])
def test_reference_agrees_with_full_weight_reference_by_the_chain_rule(
        adapters, tmp_path, name, objective):
    """Two independent routes to the adapter gradient: autograd through peft's LoRA layers,
    and tests/reference.py's full-weight gradient G at the merged weights W + s·B·A, mapped
    by ∂J/∂B = s·G·Aᵀ, ∂J/∂A = s·Bᵀ·G."""
    hf, ad = adapters[name]
    if objective == "opd":
        rows = make_opd_batch(VOCAB, n_traj=3, turns=2, seed=5)
    else:
        rows = make_batch(VOCAB, n_groups=3, m=3, seed=4)
    got = reference_lora_grad(hf, ad, rows, objective)
    merged = merge_adapter(hf, ad, str(tmp_path / "merged"))
    full = reference_opd_grad(merged, rows) if objective == "opd" else reference_grad(merged, rows)
    via_w = chain_rule_grad(full, ad)
    assert sorted(got) == sorted(read_adapter(ad)[1]) == sorted(via_w)
    assert all(g.dtype == torch.float64 and g.abs().max() > 0 for g in got.values())
    err = rel_l2(got, via_w)
    print(f"LoRA reference {name} {objective} vs chain rule on tests/reference.py: {err:.2e}")
    assert err <= 1e-12


def _tokens(b: int = 2, s: int = 21) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_match_hf_peft_tp1(parallel1, adapters, name):
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.model import bridge

    hf, ad = adapters[name]
    policy = Policy(lora_cfg(hf, ad), par=parallel1)
    rslora = ADAPTERS[name][2]
    assert policy.lora is not None and policy.lora.rank == 4 and policy.lora.rslora == rslora
    assert policy.lora.scale == (8 / 2 if rslora else 8 / 4)
    tokens = _tokens()
    with torch.no_grad():
        got = bridge.logits(policy.model, tokens)
        ref = load_peft_model(hf, ad, torch.float32)(input_ids=tokens).logits
    err = (got - ref).abs().max().item()
    print(f"{name}: Megatron + LoRA vs HF + peft logits, TP=1: max abs {err:.2e}")
    assert err <= FP32_TOL


def test_base_frozen_and_unchanged_after_ten_updates(parallel1, adapters, tmp_path):
    """Ten GRPO updates in process: every base weight bitwise equal to the checkpoint's, only
    the adapters carry gradients and optimizer state, and they move."""
    from tsync_mcore.channel.sources import BatchPlan, TrajectorySource
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    from tsync_mcore.model import lora

    hf, ad = adapters["qwen2_all"]
    policy = Policy(lora_cfg(hf, ad, **{"optim.lr": 1e-3}), par=parallel1)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters()
            if ".lora." not in n}
    trained = {n: p for n, p in policy.model.named_parameters() if ".lora." in n}
    assert trained and all(p.requires_grad for p in trained.values())
    assert not any(p.requires_grad for n, p in policy.model.named_parameters() if n in base)
    # the grad buffers hold exactly the adapters (no main_grad for the base)
    n_adapter = sum(p.numel() for p in trained.values())
    assert n_adapter <= policy.n_grad_elements < n_adapter + 4096  # + DDP bucket padding
    _, tensors = read_adapter(ad)
    before = policy.export_adapter()
    assert sorted(before) == sorted(tensors)
    assert all(torch.equal(before[k], tensors[k]) for k in tensors)

    learner = Learner(policy.cfg.learner, policy, policy_version=0)
    for v in range(10):
        rows = make_batch(VOCAB, n_groups=2, m=2, version=v, seed=7, max_len=14)
        srcs = [TrajectorySource.from_json(r) for r in rows]
        learner.begin(BatchPlan.from_sources(srcs))
        for s in srcs:
            learner.submit(s)
        assert learner.close().summary.ok
    for n, p in policy.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    after = policy.export_adapter()
    assert sorted(after) == sorted(tensors)
    for k in tensors:
        assert not torch.equal(after[k], tensors[k]), k
    # the trained adapter, written as a PEFT dir: peft loads it, and its merge_and_unload()
    # is what the policy publishes (export_params: W + s·B·A)
    out = str(tmp_path / "trained")
    lora.write_peft_dir(out, policy.lora, after, base_model=hf)
    check_merged(policy.export_params(), hf, out)


def test_fresh_adapter_is_peft_default_and_matches_reference(parallel1, tiny_qwen3, tmp_path):
    """model.lora without lora_init: PEFT's default init (A ~ U(±1/√fan_in), B = 0), so the
    model is the base model; exported with write_peft_dir, peft loads it, and the first
    update's gradient is the FP64 reference's (∂J/∂A = 0 while B = 0)."""
    from tsync_mcore.channel.sources import BatchPlan, TrajectorySource
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    from tsync_mcore.model import bridge, lora

    targets = ["q_proj", "up_proj", "down_proj"]
    policy = Policy(load_config(None, {"model.hf_dir": tiny_qwen3, "model.lora.rank": 4,
                                       "model.lora.alpha": 8.0, "model.lora.targets": targets}),
                    par=parallel1)
    init = policy.export_adapter()
    assert len(init) == 2 * 2 * len(targets)
    for k, t in init.items():
        if k.endswith("lora_B.weight"):
            assert not t.any(), k
        else:
            bound = t.shape[1] ** -0.5
            assert t.abs().max() <= bound and t.abs().max() > 0.8 * bound, k
    tokens = _tokens()
    with torch.no_grad():
        got = bridge.logits(policy.model, tokens)
        ref = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)(tokens).logits
    assert (got - ref).abs().max() <= FP32_TOL
    d = str(tmp_path / "fresh")
    lora.write_peft_dir(d, policy.lora, init, base_model=tiny_qwen3)

    rows = make_batch(VOCAB, n_groups=2, m=3, seed=9, max_len=16)
    srcs = [TrajectorySource.from_json(r) for r in rows]
    learner = Learner(policy.cfg.learner, policy, policy_version=0)
    learner.begin(BatchPlan.from_sources(srcs))
    for s in srcs:
        learner.submit(s)
    res = learner.close(export_grad=True)
    want = reference_lora_grad(tiny_qwen3, d, rows)
    assert sorted(res.grad) == sorted(want)
    assert all(not want[k].any() for k in want if k.endswith("lora_A.weight"))
    err = rel_l2(res.grad, want)
    print(f"fresh adapter, first update vs FP64 HF + peft reference: rel L2 = {err:.2e}")
    assert err <= FP32_TOL


def _one_line_error(fn) -> str:
    try:
        fn()
    except ValueError as e:  # BadFile / ConfigError / LoraError: ValueErrors naming the file
        msg = str(e)
        assert "\n" not in msg, msg
        return msg
    raise AssertionError("no error")


def test_bad_adapter_dirs_fail_with_one_line_naming_the_file(adapters, tmp_path):
    from tsync_mcore.model import bridge, lora

    hf, good = adapters["qwen2_all"]
    spec = bridge.load_hf_config(hf)
    for case, (d, named) in bad_dirs(good, tmp_path).items():
        msg = _one_line_error(lambda: lora.read_peft_dir(d, spec))
        print(f"{case}: {msg}")
        assert named in msg, (case, msg)


def test_adapter_shape_mismatch_with_the_base_model(parallel1, adapters, tmp_path):
    """qwen3's adapter (head_dim 32: q_proj is 128 wide) on qwen2 (64 wide); and a tensor
    the config's targets do not explain."""
    from safetensors.torch import save_file

    from tsync_mcore.learner.policy import Policy

    hf2, _ = adapters["qwen2_all"]
    _, ad3 = adapters["qwen3_all"]
    msg = _one_line_error(lambda: Policy(lora_cfg(hf2, ad3), par=parallel1))
    print(f"shape mismatch: {msg}")
    assert os.path.join(ad3, "adapter_model.safetensors") in msg and "(128, 4)" in msg

    import shutil
    _, sub = adapters["qwen2_sub"]
    d = tmp_path / "missing_tensor"
    shutil.copytree(sub, d)
    _, tensors = read_adapter(sub)
    tensors.pop(next(k for k in tensors if k.endswith("q_proj.lora_B.weight")))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    msg = _one_line_error(lambda: Policy(lora_cfg(hf2, str(d)), par=parallel1))
    print(f"missing tensor: {msg}")
    assert str(d / "adapter_model.safetensors") in msg
