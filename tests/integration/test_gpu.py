"""GPU-only checks (CI has no GPU: they skip with the reason): the compiled Triton kernels on
CUDA tensors, and the streaming learner on a CUDA Megatron model, each against FP64
references (torch autograd; the Hugging Face model for the learner).

On a GPU node: python -m pytest -q tests/test_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (CI has none; run this file on a GPU node)")

from tests.helpers import kernel_checks as kc  # noqa: E402
from tests.helpers.batchgen import write_batches  # noqa: E402
from tests.helpers.reference import reference_grad, rel_l2  # noqa: E402

FP32_TOL = 1e-5
ACC_FP32_REL_TOL = 1e-6


@pytest.fixture
def triton_forced(monkeypatch):
    import tsync_mcore.kernels as tk

    monkeypatch.setenv("TSYNC_KERNELS", "triton")
    assert tk.backend_for(torch.empty(0, device="cuda")) == "triton"
    return tk


# (T, V): odd sizes that are not block multiples, and the real Qwen2 vocabulary.
SHAPES = [(37, 1000), (333, 32003), (256, 151936)]


@pytest.mark.parametrize("t,v", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scored_logprob_triton_cuda(triton_forced, t, v, dtype):
    logits, targets = (x.cuda() for x in kc._make_logits(dtype, t=t, v=v))
    grad_logp = torch.randn(t, generator=torch.Generator().manual_seed(1)).cuda()
    ref_logp, ref_grad = kc._reference(logits, targets, grad_logp)  # FP64 autograd, on the GPU
    x = logits.clone().requires_grad_()
    logp = triton_forced.scored_logprob(x, targets)
    (logp * grad_logp).sum().backward()
    assert logp.dtype == torch.float32 and x.grad.dtype == dtype
    assert kc._max_abs(logp, ref_logp) <= FP32_TOL  # logp in fp32 from the exact input values
    if dtype == torch.float32:
        assert kc._max_abs(x.grad, ref_grad) <= FP32_TOL
    else:  # bf16 grads are rounded on store: within one ulp of the rounded reference
        assert kc._bf16_ulps(x.grad, ref_grad) <= 1.0


@pytest.mark.parametrize("n", [3 * 1024 + 77, (1 << 22) + 5])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32grad", "bf16grad"])
def test_grpo_accumulate_triton_cuda(triton_forced, n, grad_dtype):
    gen = torch.Generator().manual_seed(5)
    rand = lambda dt: torch.randn(n, dtype=torch.float64, generator=gen).to(dt).cuda()  # noqa: E731
    g1, g2, acc, grad = rand(torch.float32), rand(torch.float32), rand(torch.float32), rand(grad_dtype)
    errs = kc.accumulate_rel_errors(triton_forced, g1, g2, acc, grad)
    assert all(e <= ACC_FP32_REL_TOL for e in errs.values()), errs


@pytest.fixture(scope="module")
def cuda_runs(tiny_qwen2, tmp_path_factory):
    """The replay command on one GPU (fp32 and bf16 model), three updates, grads saved."""
    from tests.helpers.replay import replay

    d = tmp_path_factory.mktemp("gpu_replay")
    batch = str(d / "batch.jsonl")
    rows = write_batches(batch, 256, n_updates=3, seed=3)
    out = {"rows": rows}
    for name, flags in [("sync", ["--schedule", "sync"]),
                        ("thundersync", ["--schedule", "thundersync", "--k-open", "2"]),
                        ("thundersync_bf16", ["--schedule", "thundersync", "--dtype", "bf16"])]:
        o = str(d / name)
        out[name] = dict(summary=replay(tiny_qwen2, batch, o, 1, *flags, "--save-grads", "all"), dir=o)
    return out


def test_learner_on_cuda_matches_fp64_reference(cuda_runs, tiny_qwen2):
    rows0 = [r for r in cuda_runs["rows"] if r["policy_version"] == 0]
    ref = reference_grad(tiny_qwen2, rows0, "grpo")
    errs = {}
    for name in ("sync", "thundersync", "thundersync_bf16"):
        got = load_file(os.path.join(cuda_runs[name]["dir"], "grad_0.safetensors"))
        assert got.keys() == ref.keys()
        errs[name] = rel_l2(got, ref)
    print("CUDA learner vs FP64 HF reference, rel L2:", errs)
    assert errs["sync"] <= FP32_TOL and errs["thundersync"] <= FP32_TOL, errs
    assert errs["thundersync_bf16"] <= 3e-2, errs  # bf16 weights and activations
    assert all(cuda_runs[n]["summary"]["updates"] == 3 for n in ("sync", "thundersync"))
