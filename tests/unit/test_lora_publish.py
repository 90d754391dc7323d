"""LoRA runs out of the learner: adapter publication (publish.lora: adapter), and
refused LoRA checkpoints at export (tests/test_lora_export.py checks what export writes).

A real short LoRA run (tests/helpers/workers/export_worker.py: 2 updates, TP = 1) starts from a
PEFT adapter with non-zero A and B written by `peft` itself. The references: `peft`
(`PeftModel.from_pretrained(base, adapter).merge_and_unload()` must give the weights the
learner publishes merged), and vLLM serving the merged weights (the adapter served as a
LoRA request must sample with the same log-probs), and transformers on the merged weights.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.lora_publish_shared import (  # noqa: F401  (fixtures)
    RANK,
    base,
    lora_overrides,
    lora_run,
    peft_adapter,
)
from tests.helpers.workers.export_worker import train  # noqa: E402
from tsync_mcore.learner.export import main as export_main


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


def test_write_adapter_round_trips_a_real_policys_adapter(base, parallel1, tmp_path):
    """publish.write_adapter of a Policy started from a peft adapter writes that adapter
    back bit for bit (a PEFT directory, renamed into place); peft's merge of it equals the
    policy's merged publication; cleanup drops the unkept versions' directories."""
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.publication import send as publish

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


def test_rollout_checks_adapter_notices(tmp_path):
    """The driver accepts exactly this version's adapter directory in the private publish
    directory, by method adapter; anything else is told to the learner (a failed Ack)."""
    from tsync_mcore.channel import Ack, Publish
    from tsync_mcore.config import load_config
    from tsync_mcore.publication import send as publish
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
