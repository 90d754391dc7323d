"""Qwen3-MoE <-> Megatron MoE layers: logits and grads against HF `Qwen3MoeForCausalLM`
(eager experts), export round trips, TP = 2 and EP = 2 on 2 gloo ranks, the learner at EP = 2
(lockstep replays), refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.moe_reference import by_disk_name, load_hf_moe
from tests.helpers.moe_reference import grads as hf_grads
from tests.helpers.moe_shared import FP32_TOL


def _tokens(vocab: int, b: int = 2, s: int = 23) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def moe_unnormalised(tmp_path_factory) -> str:
    """norm_topk_prob false: the top-k keep the full softmax's probabilities."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("moe_unnorm")), arch="qwen3_moe",
                                norm_topk_prob=False, top_k=2, experts=4, seed=6)


def test_tiny_checkpoint_is_stored_per_expert(tiny_qwen3_moe):
    from tsync_mcore.model import bridge

    spec = bridge.load_hf_config(tiny_qwen3_moe)
    assert (spec.arch, spec.num_experts, spec.top_k, spec.moe_ffn) == ("qwen3_moe", 4, 2, 32)
    assert spec.norm_topk_prob and spec.qk_norm and spec.moe
    stored = bridge.load_hf_state_dict(tiny_qwen3_moe)
    assert sorted(stored) == sorted(bridge.hf_param_names(spec))
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in stored
    assert "model.layers.0.mlp.gate.weight" in stored
    assert not any("gate_up_proj" in n for n in stored)
    # what HF loads is what is stored (the fused in-memory experts split back per expert)
    hf = by_disk_name(dict(load_hf_moe(tiny_qwen3_moe).state_dict()))
    assert all(torch.equal(hf[n], t) for n, t in stored.items())


@pytest.mark.parametrize("which", ["normalised", "unnormalised"])
def test_logits_and_grads_match_hf_tp1(parallel1, tiny_qwen3_moe, moe_unnormalised, which):
    from tsync_mcore.model import bridge

    path = tiny_qwen3_moe if which == "normalised" else moe_unnormalised
    model, spec = bridge.build_model(path)
    assert model.config.moe_router_pre_softmax == (which == "unnormalised")
    tokens = _tokens(spec.vocab_size)
    weight = torch.randn(2, 23, spec.vocab_size, generator=torch.Generator().manual_seed(1))
    out = bridge.logits(model, tokens)
    (out * weight).sum().backward()
    hf = load_hf_moe(path)
    ref = hf(tokens).logits
    (ref * weight).sum().backward()
    assert ref.abs().max() > 0.5
    assert (out - ref).abs().max().item() <= FP32_TOL
    grads = bridge.export_hf({n: p.grad for n, p in model.named_parameters()}, spec)
    want = hf_grads(hf)
    assert sorted(grads) == sorted(want)
    for n, g in grads.items():
        assert (g - want[n]).abs().max() <= 1e-4 * want[n].abs().max(), n


def test_routing_reaches_every_expert(parallel1, tiny_qwen3_moe):
    """The tiny model is a real MoE test: the tokens spread over all experts of each layer."""
    hf = load_hf_moe(tiny_qwen3_moe)
    tokens = _tokens(256)
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o))
             for layer in hf.model.layers]
    with torch.no_grad():
        hf(tokens)
    for h in hooks:
        h.remove()
    for out in seen:  # (logits, scores, indices) in transformers 5
        indices = out[-1]
        assert set(indices.flatten().tolist()) == {0, 1, 2, 3}


def test_export_round_trip_tp1(parallel1, tiny_qwen3_moe):
    from tsync_mcore.model import bridge

    model, spec = bridge.build_model(tiny_qwen3_moe)
    original = bridge.load_hf_state_dict(tiny_qwen3_moe)
    exported = bridge.export_hf_state_dict(model, spec)
    assert list(exported) == bridge.hf_param_names(spec)
    assert sorted(exported) == sorted(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k


def test_aux_loss_is_off_by_default_and_configurable(parallel1, tiny_qwen3_moe):
    from tsync_mcore.model import bridge

    model, _ = bridge.build_model(tiny_qwen3_moe)
    assert model.config.moe_router_load_balancing_type == "none"
    assert model.config.moe_aux_loss_coeff == 0.0
    aux, _ = bridge.build_model(tiny_qwen3_moe, moe_aux_loss_coeff=0.01)
    assert aux.config.moe_router_load_balancing_type == "aux_loss"
    assert aux.config.moe_aux_loss_coeff == 0.01
    tokens = _tokens(256)
    # same forward; the loss only adds to the router's gradient
    for m in (model, aux):
        bridge.logits(m, tokens).sum().backward()
    r0 = model.decoder.layers[0].mlp.router.weight.grad
    r1 = aux.decoder.layers[0].mlp.router.weight.grad
    assert not torch.equal(r0, r1)


def _refused(cfg: dict) -> str:
    from tsync_mcore.model import bridge

    with pytest.raises(ValueError) as e:
        bridge.ModelSpec.from_hf_config(cfg)
    return str(e.value)


def test_bad_moe_configs_are_refused_in_one_line(tiny_qwen3_moe, tmp_path):
    from tsync_mcore.model import bridge
    from tsync_mcore.util.safe_files import ModelDirError

    cfg = json.load(open(os.path.join(tiny_qwen3_moe, "config.json")))
    cases = [
        ({"num_local_experts": 0}, "num_experts must be a positive integer"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds num_experts 4"),
        ({"moe_intermediate_size": "32"}, "moe_intermediate_size must be a positive integer"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        ({"decoder_sparse_step": 2}, "only all-MoE stacks"),
        ({"mlp_only_layers": [0]}, "only all-MoE stacks"),
        ({"shared_expert_intermediate_size": 64}, "shared experts"),
    ]
    for change, why in cases:
        msg = _refused({**cfg, **change})
        assert why in msg and "\n" not in msg, (change, msg)
    # real checkpoints spell it num_experts (transformers 5 writes num_local_experts)
    real = {k: v for k, v in cfg.items() if k != "num_local_experts"}
    assert bridge.ModelSpec.from_hf_config({**real, "num_experts": 8}).num_experts == 8
    # through a model directory: one line naming the file
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(ModelDirError) as e:
        bridge.load_hf_config(str(bad))
    assert str(bad / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_config_keys_ep_and_aux_loss(tiny_qwen3_moe):
    from tsync_mcore.config import ConfigError, load_config

    ok = load_config(None, {"model.hf_dir": tiny_qwen3_moe, "model.moe_aux_loss_coeff": 0.01,
                            "rollout.n_learners": 2})
    assert (ok.model.ep, ok.model.moe_aux_loss_coeff) == (1, 0.01)
    for overrides, match in [
        ({"model.ep": 0}, r"'model.ep': must be >= 1"),
        ({"model.moe_aux_loss_coeff": -1.0}, r"'model.moe_aux_loss_coeff'"),
        # the learner serves EP ranks in lockstep, each group on one rank
        ({"model.hf_dir": tiny_qwen3_moe, "model.ep": 2, "rollout.n_learners": 2,
          "learner.shared_prefix": False, "learner.schedule": "sync",
          "rollout.routing": "balanced"},
         r"'rollout.routing': 'balanced' with model.ep = 2: the lockstep serves each group"),
        ({"model.hf_dir": tiny_qwen3_moe, "model.tp": 2, "model.ep": 2,
          "rollout.n_learners": 4, "learner.shared_prefix": False,
          "learner.schedule": "sync"},
         r"'model.ep': 2 with model.tp 2: a mixture-of-experts model trains with one of them"),
        ({"model.hf_dir": tiny_qwen3_moe, "model.tp": 2, "rollout.n_learners": 2,
          "model.moe_aux_loss_coeff": 0.01},
         r"'model.moe_aux_loss_coeff': > 0 with model.tp 2: the load-balancing loss runs"),
        ({"model.hf_dir": tiny_qwen3_moe, "model.lora.rank": 4},
         r"'model.lora': LoRA on mixture-of-experts layers is not supported yet"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)


def test_expert_parallel_learner_refusals(tiny_qwen3_moe, tmp_path):
    """At ep > 1 what the lockstep cannot match is refused in one line naming the key: OPD,
    shared prompts, schedules that fold into a group's pair, the aux loss, balanced
    routing."""
    from tsync_mcore.config import ConfigError, load_config
    from tsync_mcore.learner import replay

    ok = {"model.hf_dir": tiny_qwen3_moe, "model.ep": 2, "learner.shared_prefix": False,
          "learner.schedule": "group_ready"}
    assert load_config(None, ok, replay=True).model.ep == 2
    for overrides, match in [
        ({"learner.objective": "opd"}, r"'learner.objective': 'opd' with model.ep = 2"),
        ({"learner.shared_prefix": True}, r"'learner.shared_prefix': true with model.ep = 2"),
        ({"model.moe_aux_loss_coeff": 0.01}, r"'model.moe_aux_loss_coeff': > 0 with model.ep"),
        ({"learner.schedule": "thundersync"},
         r"'learner.schedule': 'thundersync' with model.ep = 2: only sync and group_ready"),
    ]:
        with pytest.raises(ConfigError, match=match) as e:
            load_config(None, ok | overrides, replay=True)
        assert "\n" not in str(e.value)
    with pytest.raises(SystemExit):
        replay.parse_args(["--model", tiny_qwen3_moe, "--batch", "b", "--out", "o",
                           "--ep", "2", "--routing", "balanced"])
    live = load_config(None, {**ok, "rollout.n_learners": 2})  # the live trainer: static
    assert live.model.ep == 2 and live.rollout.routing == "static"


def test_routing_replay_config_refusals(tiny_qwen3_moe, tiny_qwen2):
    """Dense models have no routing to replay; a live run cannot take 'rollout' (the vLLM
    rollout does not record routed experts yet)."""
    from tsync_mcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'learner.routing_replay': 'learner' replays the "
                                          r"routing of mixture-of-experts layers; .* is a "
                                          r"dense model"):
        load_config(None, {"model.hf_dir": tiny_qwen2, "learner.routing_replay": "learner"})
    rollout = {"model.hf_dir": tiny_qwen3_moe, "learner.routing_replay": "rollout"}
    with pytest.raises(ConfigError, match="'rollout' needs the experts the rollout routed"):
        load_config(None, rollout)
    assert load_config(None, rollout, replay=True).learner.routing_replay == "rollout"
    load_config(None, {**rollout, "learner.routing_replay": "learner"})


def test_trained_checkpoint_exports_to_hf(tiny_qwen3_moe, parallel1, tmp_path):
    """Two real updates at TP=1, checkpointed; `python -m tsync_mcore.learner.export` writes the
    per-expert HF directory, bit for bit the learner's parameters, with its logits in HF."""
    from tests.helpers.batchgen import write_batches
    from tests.helpers.workers.export_worker import (
        train,  # tests/workers, on the path once test_export is imported
    )
    from tests.helpers.export_shared import check_against_learner
    from tsync_mcore.learner.export import main as export_main

    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, 256, n_updates=2, seed=7)
    run = str(tmp_path / "run")
    assert train(tiny_qwen3_moe, batch, run, tp=1, updates=2, par=parallel1)["version"] == 2
    out = str(tmp_path / "hf")
    assert export_main([run, "--out", out]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "qwen3_moe"
    err = check_against_learner(run, out)
    print(f"\nMoE export: HF logits vs the learner's Megatron logits max |err| {err:.1e}")


def test_resume_refuses_another_expert_parallel_layout(tiny_qwen3_moe, parallel1, tmp_path):
    """A checkpoint records model.ep (each rank file holds its own experts); an EP size its
    world cannot hold is refused naming meta.json, before anything is restored. (A resume
    with another EP size over the same ranks is refused the same way: 'written with
    model.ep N'; one rank cannot show it.)"""
    from tsync_mcore.config import load_config
    from tsync_mcore.learner import checkpoint
    from tsync_mcore.learner.policy import Policy

    policy = Policy(load_config(None, {"model.hf_dir": tiny_qwen3_moe}), par=parallel1)
    step = checkpoint.save(str(tmp_path), policy, 1, 0)
    mpath = os.path.join(step, "meta.json")
    meta = json.load(open(mpath))
    assert "ep" not in meta  # ep 1 checkpoints look as before
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    for bad, match in [(2, r"meta.json: ep 2 must be an integer >= 2 with tp × ep dividing "
                           r"world_size 1"),
                       ("2", r"meta.json: ep '2' must be an integer")]:
        json.dump({**meta, "ep": bad}, open(mpath, "w"))
        with pytest.raises(checkpoint.CheckpointError, match=match):
            checkpoint.load(step, policy)
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())
