"""tsync_mcore.kernels: numerics vs FP64 torch references, TP combine, dispatch, sm_90 AOT compile.

The Triton checks run in subprocesses (tests/kernel_checks.py): the interpreter needs
TRITON_INTERPRET=1 before Triton's first import, the AOT compile needs it unset, and
another test in this process may already have imported Triton either way. The three
subprocesses start together once per module and run concurrently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

CHECKS = Path(ROOT) / "tests" / "helpers" / "kernel_checks.py"
REPO = ROOT
BACKENDS = ("triton", "torch")  # "triton" runs through the CPU interpreter here
FP64_TOL = 1e-12
FP32_TOL = 1e-5
ACC_FP32_REL_TOL = 1e-6


@pytest.fixture(scope="module")
def checks():
    """mode -> parsed JSON result, from one concurrent run of each kernel_checks.py mode."""
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TSYNC_KERNELS")}
    with tempfile.TemporaryDirectory() as cache:
        # A fresh Triton cache makes the AOT check really compile.
        envs = {
            "numerics": {**base, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": cache},
            "aot": {**base, "TRITON_CACHE_DIR": cache},
            "no-triton": base,
        }
        procs = {
            mode: subprocess.Popen(
                [sys.executable, str(CHECKS), mode], cwd=REPO, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
            )
            for mode, env in envs.items()
        }
        results = {}
        for mode, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            results[mode] = (proc.returncode, stdout, stderr)
    parsed = {}
    for mode, (rc, stdout, stderr) in results.items():
        lines = stdout.strip().splitlines()
        parsed[mode] = json.loads(lines[-1]) if rc == 0 and lines else {"_error": f"rc={rc}\n{stderr[-4000:]}"}
    return parsed


def _result(checks: dict, mode: str) -> dict:
    res = checks[mode]
    assert "_error" not in res, res.get("_error")
    return res


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_selected(checks, backend):
    assert _result(checks, "numerics")[f"{backend}:backend_ok"] == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [("fp64", FP64_TOL), ("fp32", FP32_TOL)])
def test_scored_logprob_matches_reference(checks, backend, dtype, tol):
    res = _result(checks, "numerics")
    assert res[f"{backend}:logp_dtype_ok_{dtype}"] == 1.0
    assert res[f"{backend}:fwd_err_{dtype}"] <= tol
    assert res[f"{backend}:bwd_err_{dtype}"] <= tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_scored_logprob_bf16(checks, backend):
    res = _result(checks, "numerics")
    assert res[f"{backend}:logp_dtype_ok_bf16"] == 1.0
    # logp is computed in fp32 from the exact bf16 values.
    assert res[f"{backend}:fwd_err_bf16"] <= FP32_TOL
    # Within one bf16 ulp of the rounded reference (the interpreter truncates on store).
    assert res[f"{backend}:bwd_ulp_bf16"] <= 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_scored_logprob_nd_noncontiguous(checks, backend):
    res = _result(checks, "numerics")
    assert res[f"{backend}:nd_shape_ok"] == 1.0
    assert res[f"{backend}:nd_fwd_err_fp64"] <= FP64_TOL
    assert res[f"{backend}:nd_bwd_err_fp64"] <= FP64_TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [("fp64", FP64_TOL), ("fp32", FP32_TOL)])
def test_vocab_parallel_combine(checks, backend, dtype, tol):
    res = _result(checks, "numerics")
    assert res[f"{backend}:tp_sim_fwd_err_{dtype}"] <= tol
    assert res[f"{backend}:tp_sim_bwd_err_{dtype}"] <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [("fp64", FP64_TOL), ("fp32", FP32_TOL)])
def test_fused_lm_head(checks, backend, dtype, tol):
    """The fused LM head through this backend's partials and backward (tests/test_lm_head.py
    has the rest of its checks, on the default backend)."""
    assert _result(checks, "numerics")[f"{backend}:lm_head_err_{dtype}"] <= tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_gloo_two_ranks(checks, backend):
    res = _result(checks, "numerics")
    assert res[f"{backend}:tp_gloo_fwd_err_fp64"] <= FP64_TOL
    assert res[f"{backend}:tp_gloo_bwd_err_fp64"] <= FP64_TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [("fp64", FP64_TOL), ("fp32", FP32_TOL), ("bf16", FP32_TOL)])
def test_entropy_matches_reference(checks, backend, dtype, tol):
    """The scored tokens' entropy from the log-prob pass vs FP64 full softmax, and its
    gradient (an entropy bonus) joined to the log-prob's: unsharded, two shards combined,
    and two gloo ranks (every rank holds the full value, each its columns' gradient)."""
    res = _result(checks, "numerics")
    assert res[f"{backend}:ent_logp_same_{dtype}"] == 1.0
    assert res[f"{backend}:ent_dtype_ok_{dtype}"] == 1.0
    assert res[f"{backend}:ent_err_{dtype}"] <= tol
    if dtype != "bf16":
        assert res[f"{backend}:ent_bwd_err_{dtype}"] <= tol
        assert res[f"{backend}:tp_sim_ent_err_{dtype}"] <= tol
        assert res[f"{backend}:tp_sim_ent_bwd_err_{dtype}"] <= tol
    if dtype == "fp64":
        assert res[f"{backend}:tp_gloo_ent_err_fp64"] <= FP64_TOL
        assert res[f"{backend}:tp_gloo_ent_bwd_err_fp64"] <= FP64_TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("acc,grad,tol", [
    ("fp64", "fp64", FP64_TOL), ("fp64", "bf16", FP64_TOL),
    ("fp32", "fp32", ACC_FP32_REL_TOL), ("fp32", "bf16", ACC_FP32_REL_TOL),
])
def test_grpo_accumulate(checks, backend, acc, grad, tol):
    res = _result(checks, "numerics")
    for what in ("g1", "g2", "acc", "fresh"):
        assert res[f"{backend}:acc_rel_{what}_{acc}_{grad}grad"] <= tol, what


def test_aot_compile_sm90(checks):
    res = _result(checks, "aot")
    assert res, "no kernel variants compiled"
    # PTX must always come out; a cubin needs the ptxas bundled with the triton wheel.
    assert all(v == 1.0 for k, v in res.items() if k.endswith(":ptx")), res
    assert all(v == 1.0 for k, v in res.items() if k.endswith(":cubin")), res
    assert res["scored_logprob_bwd_bf16:bf16_store_rn"] == 1.0


def test_without_triton(checks):
    res = _result(checks, "no-triton")
    assert res["backend_is_torch"] == 1.0
    assert res["forced_triton_raises"] == 1.0
    assert res["accumulate_ok"] == 1.0
    assert res["fwd_err_fp64"] <= FP64_TOL
    assert res["bwd_err_fp64"] <= FP64_TOL
