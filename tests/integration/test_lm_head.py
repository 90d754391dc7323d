"""The fused LM head + scored log-prob (tsync_mcore/kernels/lm_head.py) against a plain
FP64 reference (full logits, log_softmax, gather, autograd): log-probs, entropy and the
gradients w.r.t. the hidden states and the weight, at TP = 1 and TP = 2 (gloo ranks); the
model side (bridge/span hand over final hidden states and the output weight, tied or not)
and the learner's update with the head on and off.

The Triton interpreter's run of the same kernel is in tests/kernel_checks.py (numerics).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.dist_util import run_dist
from tests.helpers.entropy_shared import ENT_TOL, entropy_rows, reference_entropy
from tests.helpers.lm_head_shared import (  # noqa: F401  (shared with the unit tests)
    TOL,
    WORKER,
    err,
    fused,
    hw,
    reference,
)


@pytest.fixture(scope="module")
def tp2_launch(tiny_ckpts, tmp_path_factory):
    """One 2-rank launch (lm_head_worker.py): the head's TP = 2 check, the learner's entropy
    metric at TP = 2, then the TP = 2 replays of test_replay_update_fused_equals_unfused_tp2
    (the head on and off, tied and untied). Returns the ranks' results and name → replay
    run."""
    from tests.helpers.batchgen import write_batches
    from tests.helpers.replay import job_results, write_jobs
    d = tmp_path_factory.mktemp("lm_head_tp2")
    batch = str(d / "b.jsonl")
    write_batches(batch, 256, n_updates=1, seed=9)
    off = d / "off.yaml"
    off.write_text("learner:\n  fused_lm_head: false\n")
    on = d / "on.yaml"
    on.write_text("learner:\n  lm_head_chunk: 7\n")
    jobs = {f"{ckpt}_{name}": ["--model", tiny_ckpts[ckpt], "--batch", batch, "--tp", "2",
                               "--config", str(cfg)]
            for ckpt in ("qwen2", "qwen2_tied") for name, cfg in (("on", on), ("off", off))}
    entropy = d / "entropy.json"  # test_entropy_metric_tp2's job
    entropy.write_text(json.dumps({"hf_dir": tiny_ckpts["qwen2"], "rows": [
        {"tokens": r["tokens"], "scored_mask": r["scored_mask"]} for r in entropy_rows()]}))
    ranks = run_dist([WORKER, write_jobs(jobs, str(d)), str(entropy)], nproc=2, timeout=600)
    return ranks, job_results(jobs, str(d), ranks[0]["summaries"])


def test_entropy_metric_tp2(tp2_launch, tiny_ckpts):
    """The learner's entropy metric (Policy.take_entropy) from vocab-parallel logits: each
    rank holds half the vocab; both report the full entropy, against the FP64 full-softmax
    reference (TP = 1 and the live run's: tests/integration/test_learner_metrics.py)."""
    ranks, _ = tp2_launch
    rows = entropy_rows()
    ref_sum, ref_n = reference_entropy(tiny_ckpts["qwen2"], rows)
    assert [r["entropy"]["tp_size"] for r in ranks] == [2, 2]
    for r in (r["entropy"] for r in ranks):
        assert r["tokens"] == ref_n
        assert abs(r["entropy_sum"] / r["tokens"] - ref_sum / ref_n) <= ENT_TOL
        assert r["after_take"] == [0.0, 0]


def test_tensor_parallel_two_ranks(tp2_launch):
    ranks, _ = tp2_launch
    for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        hidden, weight, targets, grad = hw.problem(dtype)
        logp, ent, gh, gw = reference(hidden, weight, targets, grad, grad.flip(0))
        for r in ranks:
            got = {k: torch.tensor(v, dtype=torch.float64) for k, v in r[name].items()}
            errs = {"logp": err(got["logp"], logp), "ent": err(got["ent"], ent),
                    "grad_h": err(got["grad_h"], gh),  # whole on every rank (all-reduced)
                    "grad_w": err(got["grad_w"], gw[r["start"]:r["stop"]])}
            print(f"TP=2 rank {r['tp_rank']} {name}: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
            assert max(errs.values()) <= TOL[dtype], errs


def _rel(a: dict, b: dict) -> float:
    from tests.helpers.reference import rel_l2
    return rel_l2(a, b)


@pytest.fixture(scope="module")
def fused_runs(tiny_qwen2, tmp_path_factory):
    """Both objectives' replays, shared prompts on and off, the head fused and not: one
    process (each job its own Policy and Learner, see replay_many)."""
    from tests.helpers.batchgen import write_batches, write_opd_batches
    from tests.helpers.replay import replay_many
    d = tmp_path_factory.mktemp("fused_head")
    jobs = {}
    for objective in ("grpo", "opd"):
        batch = str(d / f"{objective}.jsonl")
        if objective == "grpo":
            write_batches(batch, 256, n_updates=1, seed=8)
        else:
            write_opd_batches(batch, 256, n_updates=1, seed=8, n_traj=4, group_size=2)
        for prefix in ("true", "false"):
            for fused in ("true", "false"):
                cfg = d / f"p{prefix}_f{fused}.yaml"
                cfg.write_text(f"learner:\n  shared_prefix: {prefix}\n  fused_lm_head: {fused}\n"
                               f"  lm_head_chunk: 7\n")
                jobs[f"{objective}_prefix_{prefix}_fused_{fused}"] = [
                    "--model", tiny_qwen2, "--batch", batch, "--objective", objective,
                    "--config", str(cfg), "--lr", "1e-5"]
    return replay_many(jobs, str(d), nproc=1)


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_replay_update_fused_equals_unfused(fused_runs, objective):
    """Schedule thundersync, shared prompts on and off: the update's gradient and θ after its
    step agree within FP32 rounding with the head on and off. (One update: Adam's first step
    moves a parameter by ±lr whatever its gradient's size, so a later update's gradient
    would also measure rounding noise amplified.)"""
    from safetensors.torch import load_file

    runs = {k[len(objective) + 1:]: v for k, v in fused_runs.items() if k.startswith(objective)}
    for prefix in ("true", "false"):
        on, off = (runs[f"prefix_{prefix}_fused_{f}"] for f in ("true", "false"))
        for name in ("grad", "params"):
            a, b = (load_file(os.path.join(r["dir"], f"{name}.safetensors")) for r in (on, off))
            e = _rel(a, b)
            print(f"{objective} shared_prefix {prefix}: {name} fused vs unfused rel L2 {e:.1e}")
            assert e <= 1e-6, (prefix, name, e)
        peaks = [r["summary"]["head_peak_bytes_per_rank"][0] for r in (on, off)]
        assert all(p > 0 for p in peaks)


def test_replay_update_fused_equals_unfused_tp2(tp2_launch):
    """TP = 2 (vocab-parallel head, the hidden gradient all-reduced over TP), tied and untied."""
    from safetensors.torch import load_file

    _, runs = tp2_launch
    for ckpt in ("qwen2", "qwen2_tied"):
        a, b = (load_file(os.path.join(runs[f"{ckpt}_{n}"]["dir"], "grad.safetensors"))
                for n in ("on", "off"))
        e = _rel(a, b)
        print(f"TP=2 {ckpt}: fused vs unfused rel L2 {e:.1e}")
        assert e <= 1e-6


def test_fused_head_peak_memory_below_unfused(tmp_path):
    """Each run in a process of its own (the peak RSS is per process and cannot be reset): with
    fp32 logits of 2048 × 65,536 (512 MiB, and as much again for their gradient, several
    copies at the unfused head's peak) the fused head's peak resident memory is at least
    0.5 GB lower."""
    import json
    import subprocess
    import sys

    from tests.helpers.dist_util import REPO_ROOT, parse_results
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    t, vocab = 2048, 65536
    ckpt = make_tiny_checkpoint(str(tmp_path / "ckpt"), vocab_size=vocab, hidden=16, layers=1,
                                heads=2, kv_heads=1, intermediate=32, max_positions=t)
    gen = torch.Generator().manual_seed(0)
    # one t-token trajectory, all but its prompt scored
    row = dict(traj_id="t", group_id="g", tokens=torch.randint(0, vocab, (t,), generator=gen).tolist(),
               prompt_len=8, scored_mask=[0] * 8 + [1] * (t - 8), reward=1.0, policy_version=0)
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps(row) + "\n")
    # the two processes side by side (peak RSS is per process), 1 thread each
    procs = {}
    for fused in ("true", "false"):
        cfg = tmp_path / f"{fused}.yaml"
        cfg.write_text(f"learner:\n  fused_lm_head: {fused}\n  lm_head_chunk: 512\n")
        procs[fused] = subprocess.Popen(
            [sys.executable, os.path.join(REPO_ROOT, "tests/helpers/workers/head_memory_worker.py"),
             "--model", ckpt, "--batch", str(batch), "--config", str(cfg),
             "--out", str(tmp_path / fused)],
            cwd=REPO_ROOT, stdout=open(tmp_path / f"{fused}.out", "w"),
            stderr=open(tmp_path / f"{fused}.err", "w"),
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT))
    peaks = {}
    try:
        for fused, p in procs.items():
            assert p.wait(timeout=600) == 0, (tmp_path / f"{fused}.err").read_text()[-4000:]
            out = (tmp_path / f"{fused}.out").read_text()
            res = parse_results(out)[0]
            peaks[fused] = (res["peak_rss_bytes"], res["summary"]["head_peak_bytes_per_rank"][0])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    (on, est_on), (off, est_off) = peaks["true"], peaks["false"]
    print(f"T={t} V={vocab} fp32 peak RSS: fused {on / 2**30:.2f} GiB, unfused "
          f"{off / 2**30:.2f} GiB (head estimates {est_on / 2**20:.0f} / {est_off / 2**20:.0f} MiB)")
    assert off - on >= 0.5e9
    assert est_off - est_on >= 0.5e9
