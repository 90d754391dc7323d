"""LoRA policies against Hugging Face + peft (FP64 references in tests/lora_reference.py).

Adapters are PEFT directories with non-zero A and B, saved by peft itself, on the tiny
checkpoints of tests/conftest.py: every target, PEFT's default subset (q_proj, v_proj), and
an odd mix (k_proj alone in the fused QKV, up_proj alone in fc1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batchgen import write_batches, write_opd_batches
from tests.helpers.dist_util import run_dist
from tests.helpers.lora_reference import (
    load_peft_model,
    read_adapter,
    reference_lora_grad,
)
from tests.helpers.lora_shared import (  # noqa: F401  (shared with the unit tests)
    ADAPTERS,
    FP32_TOL,
    VOCAB,
    adapters,
    bad_dirs,
    check_merged,
    lora_cfg,
    max_rel,
    rename_first,
)
from tests.helpers.paths import ROOT
from tests.helpers.reference import rel_l2

WORKER = os.path.join(ROOT, "tests", "helpers", "workers", "lora_worker.py")


REPLAY_RUNS = {  # name -> (adapter, objective, TP, schedule flags)
    "grpo_sync_all": ("qwen2_all", "grpo", 1, ["--schedule", "sync"]),
    "grpo_ts_all": ("qwen2_all", "grpo", 1, ["--schedule", "thundersync", "--k-open", "2"]),
    "grpo_sync_sub": ("qwen2_sub", "grpo", 1, ["--schedule", "sync"]),
    "grpo_ts_sub": ("qwen2_sub", "grpo", 1, ["--schedule", "thundersync", "--k-open", "1"]),
    "opd_sync_all": ("qwen2_all", "opd", 1, ["--schedule", "sync"]),
    "opd_ts_all": ("qwen2_all", "opd", 1, ["--schedule", "thundersync"]),
    "opd_ts_sub": ("qwen2_sub", "opd", 1, ["--schedule", "thundersync"]),
    "tp2_grpo_sync_all": ("qwen3_all", "grpo", 2, ["--schedule", "sync"]),
    "tp2_grpo_ts_all": ("qwen3_all", "grpo", 2, ["--schedule", "thundersync", "--k-open", "2"]),
    "tp2_opd_sync_sub": ("llama_tied_sub", "opd", 2, ["--schedule", "sync"]),
    "tp2_opd_ts_sub": ("llama_tied_sub", "opd", 2, ["--schedule", "thundersync"]),
    "tp2_grpo_ts_mix": ("qwen3_tied_mix", "grpo", 2, ["--schedule", "thundersync"]),
    "tp2_opd_ts_rslora": ("llama_rslora", "opd", 2, ["--schedule", "thundersync"]),
}


PAIRS = [("grpo_ts_all", "grpo_sync_all"), ("grpo_ts_sub", "grpo_sync_sub"),
         ("opd_ts_all", "opd_sync_all"), ("tp2_grpo_ts_all", "tp2_grpo_sync_all"),
         ("tp2_opd_ts_sub", "tp2_opd_sync_sub")]


@pytest.fixture(scope="module")
def lora_launch(adapters, tmp_path_factory):
    """One 2-rank launch (tests/helpers/workers/lora_worker.py): tp2_results' checks, then
    the replays of REPLAY_RUNS (TP = 1 first, then TP = 2; each job its own Policy and
    Learner, as in replay_many)."""
    from tests.helpers.replay import job_results, write_jobs

    d = tmp_path_factory.mktemp("lora_replay")
    grpo, opd = str(d / "grpo.jsonl"), str(d / "opd.jsonl")
    rows = {"grpo": write_batches(grpo, VOCAB, n_updates=1, seed=3),
            "opd": write_opd_batches(opd, VOCAB, n_updates=1, seed=2, turns=3)}
    jobs = {}
    for tp in (1, 2):
        for name, (adapter, objective, run_tp, flags) in REPLAY_RUNS.items():
            if run_tp != tp:
                continue
            hf, ad = adapters[adapter]
            jobs[name] = ["--model", hf, "--lora-adapter", ad, "--objective", objective,
                          "--batch", grpo if objective == "grpo" else opd, "--tp", str(tp),
                          "--lr", "1e-4", *flags]
    out = str(tmp_path_factory.mktemp("lora_tp2"))
    cfg = {"adapters": adapters, "out": out, "replays": write_jobs(jobs, str(d))}
    res = run_dist([WORKER, json.dumps(cfg)], nproc=2, timeout=900)
    return dict(ranks=res, out=out, replays=(job_results(jobs, str(d), res[0]["summaries"]), rows))


@pytest.fixture(scope="module")
def replays(lora_launch):
    """The replays of REPLAY_RUNS (name → run) and their batches' rows."""
    return lora_launch["replays"]


def _load(run, what="grad"):
    return load_file(os.path.join(run["dir"], f"{what}.safetensors"))


def test_replay_thundersync_matches_sync(replays):
    runs, _ = replays
    for a, b in PAIRS:
        err = rel_l2(_load(runs[a]), _load(runs[b]))
        print(f"LoRA {a} vs {b}: direction rel L2 = {err:.2e}")
        assert err <= 1e-6, (a, b, err)


def test_replay_matches_fp64_peft_reference(replays, adapters):
    runs, rows = replays
    refs: dict[tuple[str, str], dict] = {}
    for name, (adapter, objective, tp, _) in REPLAY_RUNS.items():
        assert runs[name]["summary"]["tp"] == tp
        if (adapter, objective) not in refs:
            refs[adapter, objective] = reference_lora_grad(*adapters[adapter], rows[objective],
                                                           objective)
        ref = refs[adapter, objective]
        got = _load(runs[name])
        assert sorted(got) == sorted(ref) == sorted(read_adapter(adapters[adapter][1])[1])
        err = rel_l2(got, ref)
        print(f"LoRA {name} vs FP64 HF + peft reference: rel L2 = {err:.2e}, "
              f"max rel = {max_rel(got, ref):.2e}")
        assert err <= FP32_TOL, (name, err)


def test_replay_params_are_the_adapters_after_the_step(replays, adapters):
    runs, _ = replays
    for name, (adapter, _, _, _) in REPLAY_RUNS.items():
        _, initial = read_adapter(adapters[adapter][1])
        params = _load(runs[name], "params")
        assert sorted(params) == sorted(initial), name  # adapters only, PEFT names
        assert all(params[k].shape == initial[k].shape for k in initial)
        assert all(not torch.equal(params[k], initial[k]) for k in initial), name
    for a, b in PAIRS:
        pa, pb = _load(runs[a], "params"), _load(runs[b], "params")
        assert max_rel(pa, pb) <= 1e-5, (a, b)


@pytest.fixture(scope="module")
def tp2_results(lora_launch):
    """Logits, adapter export and merged export of every adapter, TP = 2 (lora_launch)."""
    return dict(ranks=lora_launch["ranks"], out=lora_launch["out"])


def test_logits_match_hf_peft_tp2(tp2_results, adapters):
    assert all(r["tp_size"] == 2 for r in tp2_results["ranks"])
    tokens = load_file(os.path.join(tp2_results["out"], "tokens.safetensors"))["tokens"]
    for name, (hf, ad) in adapters.items():
        got = load_file(os.path.join(tp2_results["out"], f"logits_{name}.safetensors"))["logits"]
        with torch.no_grad():
            ref = load_peft_model(hf, ad, torch.float32)(input_ids=tokens).logits
        err = (got - ref).abs().max().item()
        print(f"{name}: Megatron + LoRA vs HF + peft logits, TP=2: max abs {err:.2e}")
        assert err <= FP32_TOL, name


def test_export_adapter_round_trip_tp2(tp2_results):
    for r in tp2_results["ranks"]:
        for name in ADAPTERS:
            assert r[name]["export_names_equal"], name
            assert r[name]["export_exact"], name


@pytest.mark.parametrize("name", ["qwen3_all", "llama_tied_sub", "llama_rslora"])
def test_merged_export_equals_peft_merge_and_unload(parallel1, adapters, tp2_results, name):
    from tsync_mcore.learner.policy import Policy

    hf, ad = adapters[name]
    check_merged(Policy(lora_cfg(hf, ad), par=parallel1).export_params(), hf, ad)  # TP = 1
    check_merged(load_file(os.path.join(tp2_results["out"], f"merged_{name}.safetensors")),
                  hf, ad)  # TP = 2


def test_replay_cli_bad_adapter_one_line(adapters, tmp_path):
    hf, good = adapters["qwen2_sub"]
    d, named = bad_dirs(good, tmp_path)["dora"]
    batch = str(tmp_path / "b.jsonl")
    write_batches(batch, VOCAB, n_updates=1, seed=1)
    p = subprocess.run([sys.executable, "-m", "tsync_mcore.learner.replay", "--model", hf, "--batch",
                        batch, "--out", str(tmp_path / "out"), "--lora-adapter", d],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1, p.stderr[-3000:]
    assert err.startswith("error: ") and named in err and "dora" in err.lower()
    assert not os.path.exists(tmp_path / "out" / "grad.safetensors")
