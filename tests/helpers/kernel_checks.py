"""Kernel checks that need a fresh process; tests/test_kernels.py runs them and asserts.

    TRITON_INTERPRET=1 python tests/helpers/kernel_checks.py numerics   # Triton interpreter + torch fallback
    python tests/helpers/kernel_checks.py aot                           # ahead-of-time compile for sm_90
    python tests/helpers/kernel_checks.py no-triton                     # package works with triton unimportable

Triton reads TRITON_INTERPRET at its first import, and other tests in a pytest process
may import Triton first, hence the subprocess. Each mode prints one JSON object as the
last stdout line: metric name -> number (errors are max abs / max rel as named).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch  # noqa: E402

T, V = 37, 1000  # V is not a multiple of the interpreter BLOCK_V (128)
N_FLAT = 3 * 1024 + 77  # not a multiple of the accumulate BLOCK (1024)
SHARD_SPLIT = 437  # uneven 2-way vocab split
BACKENDS = {"triton": "triton-interpreter", "torch": "torch"}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max distance of bf16 ``got`` from ``ref`` rounded to bf16, in ulps of the latter."""
    ref_b = ref.to(torch.bfloat16).double()
    tiny = torch.finfo(torch.bfloat16).tiny
    ulp = torch.exp2(torch.floor(torch.log2(ref_b.abs().clamp_min(tiny)))) * torch.finfo(torch.bfloat16).eps
    return ((got.double() - ref_b).abs() / ulp).max().item()


def _make_logits(dtype: torch.dtype, seed: int = 0, t: int = T,
                 v: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(t, v, generator=gen, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, v, (t,), generator=gen)
    targets[0], targets[1] = 0, v - 1  # vocab edges
    # Row 2: masked vocab prefix spanning whole chunks (max is -inf for the first chunks).
    logits[2, : 3 * v // 10] = float("-inf")
    targets[2] = 512 * v // 1000
    return logits, targets


def _reference(logits: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor):
    """FP64 autograd reference: logp and dL/dlogits for L = sum(grad_logp * logp)."""
    x = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (logp * grad_logp.double()).sum().backward()
    return logp.detach(), x.grad


def _entropy_reference(logits: torch.Tensor) -> torch.Tensor:
    """FP64 entropy of each row's full softmax, -sum p log p (p = 0 terms count 0)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * torch.where(torch.isneginf(logp), 0.0, logp)).sum(dim=-1)


def _entropy_grad_reference(logits, targets, grad_logp, grad_ent) -> torch.Tensor:
    """FP64 autograd dL/dlogits for L = sum(grad_logp * logp + grad_ent * entropy)."""
    x = logits.detach().double().requires_grad_()
    logsm = torch.log_softmax(x, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logsm.exp() * torch.where(torch.isneginf(logsm), 0.0, logsm)).sum(dim=-1)
    (logp * grad_logp.double() + ent * grad_ent.double()).sum().backward()
    return torch.nan_to_num(x.grad)


def _check_scored_logprob(out: dict) -> None:
    import tsync_mcore.kernels as tk

    for name, dtype in DTYPES.items():
        logits, targets = _make_logits(dtype)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        grad_logp = torch.randn(T, dtype=out_dtype, generator=torch.Generator().manual_seed(1))
        ref_logp, ref_grad = _reference(logits, targets, grad_logp)

        x = logits.clone().requires_grad_()
        logp = tk.scored_logprob(x, targets)
        (logp * grad_logp).sum().backward()
        out[f"logp_dtype_ok_{name}"] = float(logp.dtype == out_dtype and x.grad.dtype == dtype)
        out[f"fwd_err_{name}"] = _max_abs(logp, ref_logp)
        out[f"bwd_err_{name}"] = _max_abs(x.grad, ref_grad)
        if dtype == torch.bfloat16:
            # bf16 grads are rounded on store: judge them in bf16 ulps of the rounded reference.
            out[f"bwd_ulp_{name}"] = _bf16_ulps(x.grad, ref_grad)
        # with_entropy: the same logp, and the entropy from the same pass; unused, it leaves
        # the gradient bit for bit; used (an entropy bonus), its gradient joins the logp's.
        y = logits.clone().requires_grad_()
        logp2, ent = tk.scored_logprob(y, targets, with_entropy=True)
        (logp2 * grad_logp).sum().backward()
        out[f"ent_logp_same_{name}"] = float(torch.equal(logp2.detach(), logp.detach())
                                             and torch.equal(y.grad, x.grad))
        out[f"ent_dtype_ok_{name}"] = float(ent.requires_grad and ent.dtype == out_dtype)
        out[f"ent_err_{name}"] = _max_abs(ent, _entropy_reference(logits))
        if dtype != torch.bfloat16:
            grad_ent = torch.randn(T, dtype=out_dtype, generator=torch.Generator().manual_seed(8))
            z = logits.clone().requires_grad_()
            logp3, ent3 = tk.scored_logprob(z, targets, with_entropy=True)
            (logp3 * grad_logp + ent3 * grad_ent).sum().backward()
            out[f"ent_bwd_err_{name}"] = _max_abs(
                z.grad, _entropy_grad_reference(logits, targets, grad_logp, grad_ent))

    # [..., V] input that is not contiguous, flattened and reshaped back by the wrapper.
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(2, V, 3, dtype=torch.float64, generator=gen).transpose(1, 2)  # [2, 3, V]
    targets = torch.randint(0, V, (2, 3), generator=gen)
    grad_logp = torch.randn(2, 3, dtype=torch.float64, generator=gen)
    ref_logp, ref_grad = _reference(base, targets, grad_logp)
    x = base.clone().requires_grad_()
    logp = tk.scored_logprob(x, targets)
    (logp * grad_logp).sum().backward()
    out["nd_shape_ok"] = float(logp.shape == (2, 3) and x.grad.shape == base.shape)
    out["nd_fwd_err_fp64"] = _max_abs(logp, ref_logp)
    out["nd_bwd_err_fp64"] = _max_abs(x.grad, ref_grad)


def _check_vocab_parallel(out: dict) -> None:
    """Two shards combined with the same function the autograd uses == unsharded."""
    import tsync_mcore.kernels as tk

    for name in ("fp64", "fp32"):
        logits, targets = _make_logits(DTYPES[name], seed=3)
        grad_logp = torch.randn(T, dtype=DTYPES[name], generator=torch.Generator().manual_seed(4))
        ref_logp, ref_grad = _reference(logits, targets, grad_logp)
        shards = [(0, logits[:, :SHARD_SPLIT]), (SHARD_SPLIT, logits[:, SHARD_SPLIT:])]
        parts = [tk.logprob_partials(shard, targets, start) for start, shard in shards]
        lse, tgt = tk.combine_partials(parts)
        ent_parts = [tk.logprob_partials(shard, targets, start, entropy=True) for start, shard in shards]
        out[f"tp_sim_ent_err_{name}"] = _max_abs(tk.combine_entropy(ent_parts), _entropy_reference(logits))
        grads = [tk.scored_logprob_backward(shard, targets, start, lse, grad_logp) for start, shard in shards]
        out[f"tp_sim_fwd_err_{name}"] = _max_abs(tgt - lse, ref_logp)
        out[f"tp_sim_bwd_err_{name}"] = _max_abs(torch.cat(grads, dim=1), ref_grad)
        # the entropy's gradient per shard from the global lse and H: no collective
        grad_ent = torch.randn(T, dtype=DTYPES[name], generator=torch.Generator().manual_seed(9))
        ent = tk.combine_entropy(ent_parts)
        grads = [tk.scored_logprob_backward(shard, targets, start, lse, grad_logp, grad_ent=grad_ent,
                                            ent=ent) for start, shard in shards]
        out[f"tp_sim_ent_bwd_err_{name}"] = _max_abs(
            torch.cat(grads, dim=1), _entropy_grad_reference(logits, targets, grad_logp, grad_ent))


def _check_accumulate(out: dict) -> None:
    import tsync_mcore.kernels as tk

    gen = torch.Generator().manual_seed(5)

    def rand(dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(N_FLAT, dtype=torch.float64, generator=gen).to(dtype)

    for acc_name in ("fp64", "fp32"):
        acc_dtype = DTYPES[acc_name]
        for grad_name in (acc_name, "bf16"):
            g1, g2, acc, grad = rand(acc_dtype), rand(acc_dtype), rand(acc_dtype), rand(DTYPES[grad_name])
            key = f"{acc_name}_{grad_name}grad"
            for what, err in accumulate_rel_errors(tk, g1, g2, acc, grad).items():
                out[f"acc_rel_{what}_{key}"] = err


def accumulate_rel_errors(tk, g1, g2, acc, grad) -> dict[str, float]:
    """accumulate_g1g2_, combine_group_ and axpy_ in sequence (in place, on any device) vs an
    FP64 reference: max abs error over max |ref| for g1, g2 and acc."""
    r, mu, scale, a = 0.7310585786300049, 0.1234567890123, 1.0 / 3.0, -2.718281828459045
    # copy=True: .double() of an fp64 tensor would alias the in-place-updated input.
    g1_ref, g2_ref, acc_ref, grad_ref = (t.to(torch.float64, copy=True) for t in (g1, g2, acc, grad))
    tk.accumulate_g1g2_(g1, g2, grad, r)
    g1_ref, g2_ref = g1_ref + r * grad_ref, g2_ref + grad_ref
    tk.combine_group_(acc, g1, g2, mu, scale)
    acc_ref = acc_ref + (g1_ref - mu * g2_ref) * scale
    tk.axpy_(acc, grad, a)
    acc_ref = acc_ref + a * grad_ref
    # fresh: the old contents (NaN here, as a reused buffer may hold) are never read
    fresh = torch.full_like(acc, float("nan"))
    tk.axpy_(fresh, grad, a, fresh=True)
    return {what: _max_abs(got, ref) / ref.abs().max().item()
            for what, got, ref in (("g1", g1, g1_ref), ("g2", g2, g2_ref), ("acc", acc, acc_ref),
                                   ("fresh", fresh, a * grad_ref))}


def _tp_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    """One TP rank: scored_logprob on its vocab shard with a real gloo group, both backends."""
    import torch.distributed as dist

    import tsync_mcore.kernels as tk

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    logits, targets = _make_logits(torch.float64, seed=6)
    grad_logp = torch.randn(T, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    start, stop = (0, SHARD_SPLIT) if rank == 0 else (SHARD_SPLIT, V)
    results = {}
    for backend in BACKENDS:
        os.environ["TSYNC_KERNELS"] = backend
        shard = logits[:, start:stop].clone().requires_grad_()
        logp = tk.scored_logprob(shard, targets, vocab_start=start, tp_group=group)
        (logp * grad_logp).sum().backward()
        both = logits[:, start:stop].clone().requires_grad_()
        _, ent = tk.scored_logprob(both, targets, vocab_start=start, tp_group=group, with_entropy=True)
        (ent * grad_logp.flip(0)).sum().backward()  # the entropy's gradient alone
        results[backend] = {"logp": logp.detach(), "grad": shard.grad, "ent": ent.detach(),
                            "ent_grad": both.grad, "start": start, "stop": stop}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _check_tp_gloo(out: dict) -> None:
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_tp_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{i}.pt")) for i in range(world)]
    logits, targets = _make_logits(torch.float64, seed=6)
    grad_logp = torch.randn(T, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ref_logp, ref_grad = _reference(logits, targets, grad_logp)
    for backend in BACKENDS:
        res = [r[backend] for r in ranks]
        # Every rank must hold the full-vocab logp; each holds the grad of its own columns.
        out[f"{backend}:tp_gloo_fwd_err_fp64"] = max(_max_abs(r["logp"], ref_logp) for r in res)
        out[f"{backend}:tp_gloo_bwd_err_fp64"] = _max_abs(torch.cat([r["grad"] for r in res], dim=1), ref_grad)
        out[f"{backend}:tp_gloo_ent_err_fp64"] = max(_max_abs(r["ent"], _entropy_reference(logits)) for r in res)
        ent_ref = _entropy_grad_reference(logits, targets, torch.zeros_like(grad_logp), grad_logp.flip(0))
        out[f"{backend}:tp_gloo_ent_bwd_err_fp64"] = _max_abs(
            torch.cat([r["ent_grad"] for r in res], dim=1), ent_ref)


def _check_lm_head(out: dict) -> None:
    """The fused LM head (kernels/lm_head.py) on this backend vs FP64 full logits + autograd."""
    import tsync_mcore.kernels as tk

    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(T, 16, generator=gen, dtype=torch.float64)
    weight = 0.5 * torch.randn(V, 16, generator=gen, dtype=torch.float64)
    _, targets = _make_logits(torch.float64, seed=12)
    grad_logp = torch.randn(T, generator=gen, dtype=torch.float64)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logsm = torch.log_softmax(ref_h @ ref_w.t(), -1)
    ref = logsm.gather(1, targets[:, None])[:, 0]
    (ref * grad_logp).sum().backward()
    ref_ent = -(logsm.exp() * logsm).sum(-1)
    for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        h = hidden.to(dtype, copy=True).requires_grad_()
        w = weight.to(dtype, copy=True).requires_grad_()
        logp, ent = tk.fused_lm_head_logprob(h, w, targets, chunk=10, with_entropy=True)
        (logp * grad_logp.to(dtype)).sum().backward()
        out[f"lm_head_err_{name}"] = max(
            _max_abs(a, b) / max(b.abs().max().item(), 1.0)
            for a, b in ((logp, ref), (ent, ref_ent), (h.grad, ref_h.grad), (w.grad, ref_w.grad)))


def numerics() -> dict:
    import tsync_mcore.kernels as tk

    out: dict = {}
    probe = torch.zeros(1)
    for backend, expected in BACKENDS.items():
        os.environ["TSYNC_KERNELS"] = backend
        out[f"{backend}:backend_ok"] = float(tk.backend_for(probe) == expected)
        part: dict = {}
        _check_scored_logprob(part)
        _check_vocab_parallel(part)
        _check_accumulate(part)
        _check_lm_head(part)
        out.update({f"{backend}:{k}": v for k, v in part.items()})
    del os.environ["TSYNC_KERNELS"]
    _check_tp_gloo(out)  # each rank runs both backends
    return out


def aot() -> dict:
    """Compile every kernel variant the wrappers launch, for sm_90, with no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tsync_mcore.kernels import grpo_accumulate_kernels as acc_k
    from tsync_mcore.kernels import scored_logprob_kernels as lp_k

    target = GPUTarget("cuda", 90, 32)
    aligned = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned, as the JIT would note

    def build(fn, signature: dict, constexprs: dict, num_warps: int) -> dict:
        pointers = [i for i, ty in enumerate(signature.values()) if ty.startswith("*")]
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs={(i,): aligned for i in pointers})
        asm = triton.compile(src, target=target, options={"num_warps": num_warps}).asm
        ptx = asm.get("ptx", "")
        result = {"ptx": float(".target sm_90" in ptx), "cubin": float(len(asm.get("cubin", b"")) > 0)}
        if signature.get("grad_logits_ptr") == "*bf16":
            # The interpreter truncates fp32 -> bf16; the compiled store must round to nearest.
            result["bf16_store_rn"] = float("cvt.rn.bf16" in ptx)
        return result

    lp = {"BLOCK_V": lp_k.GPU_BLOCK_V}
    acc = {"BLOCK": acc_k.BLOCK}
    variants = {}
    for logits_ty, acc_ty in (("fp32", "fp32"), ("bf16", "fp32"), ("fp64", "fp64")):
        fwd_sig = {
            "logits_ptr": f"*{logits_ty}", "targets_ptr": "*i64",
            "m_ptr": f"*{acc_ty}", "s_ptr": f"*{acc_ty}", "tgt_ptr": f"*{acc_ty}", "w_ptr": f"*{acc_ty}",
            "n_cols": "i32", "stride_row": "i32", "vocab_start": "i32", "BLOCK_V": "constexpr",
            "ENTROPY": "constexpr",
        }
        bwd_sig = {
            "logits_ptr": f"*{logits_ty}", "targets_ptr": "*i64", "lse_ptr": f"*{acc_ty}",
            "grad_logp_ptr": f"*{acc_ty}", "grad_logits_ptr": f"*{logits_ty}",
            "grad_ent_ptr": f"*{acc_ty}", "ent_ptr": f"*{acc_ty}",
            "n_cols": "i32", "stride_row": "i32", "grad_stride_row": "i32", "vocab_start": "i32",
            "BLOCK_V": "constexpr", "ENTROPY": "constexpr",
        }
        for ent in (False, True):
            variants[f"scored_logprob_fwd_{logits_ty}{'_entropy' * ent}"] = (
                lp_k.scored_logprob_fwd_kernel, fwd_sig, dict(lp, ENTROPY=ent), lp_k.GPU_NUM_WARPS)
            if ent and logits_ty != "fp32":
                continue  # the entropy's backward term: one compile shows it lowers
            variants[f"scored_logprob_bwd_{logits_ty}{'_entropy' * ent}"] = (
                lp_k.scored_logprob_bwd_kernel, bwd_sig, dict(lp, ENTROPY=ent), lp_k.GPU_NUM_WARPS)
    for acc_ty, grad_ty in (("fp32", "bf16"), ("fp32", "fp32"), ("fp64", "bf16")):
        sig = {"g1_ptr": f"*{acc_ty}", "g2_ptr": f"*{acc_ty}", "grad_ptr": f"*{grad_ty}", "r": "fp64",
               "n_elements": "i64", "BLOCK": "constexpr"}
        variants[f"accumulate_g1g2_{acc_ty}_{grad_ty}"] = (acc_k.accumulate_g1g2_kernel, sig, acc, acc_k.NUM_WARPS)
    for acc_ty in ("fp32", "fp64"):
        sig = {"acc_ptr": f"*{acc_ty}", "g1_ptr": f"*{acc_ty}", "g2_ptr": f"*{acc_ty}", "mu": "fp64",
               "scale": "fp64", "n_elements": "i64", "BLOCK": "constexpr"}
        variants[f"combine_group_{acc_ty}"] = (acc_k.combine_group_kernel, sig, acc, acc_k.NUM_WARPS)
    for acc_ty, grad_ty in (("fp32", "bf16"), ("fp32", "fp32"), ("fp64", "fp32")):
        sig = {"acc_ptr": f"*{acc_ty}", "grad_ptr": f"*{grad_ty}", "a": "fp64", "n_elements": "i64",
               "BLOCK": "constexpr", "FRESH": "constexpr"}
        for fresh in (False, True):
            variants[f"axpy_{acc_ty}_{grad_ty}{'_fresh' * fresh}"] = (
                acc_k.axpy_kernel, sig, dict(acc, FRESH=fresh), acc_k.NUM_WARPS)

    out = {}
    for name, (fn, signature, constexprs, num_warps) in variants.items():
        for kind, ok in build(fn, signature, constexprs, num_warps).items():
            out[f"{name}:{kind}"] = ok
    return out


def no_triton() -> dict:
    """With triton unimportable the package imports and every entry point runs on torch."""
    sys.modules["triton"] = None  # makes `import triton` raise ImportError
    import tsync_mcore.kernels as tk

    logits, targets = _make_logits(torch.float64)
    x = logits.clone().requires_grad_()
    logp = tk.scored_logprob(x, targets)
    logp.sum().backward()
    ref_logp, ref_grad = _reference(logits, targets, torch.ones(T, dtype=torch.float64))
    g1, g2, grad = torch.zeros(N_FLAT), torch.zeros(N_FLAT), torch.ones(N_FLAT, dtype=torch.bfloat16)
    tk.accumulate_g1g2_(g1, g2, grad, 2.0)
    backend = tk.backend_for(logits)
    os.environ["TSYNC_KERNELS"] = "triton"
    try:
        tk.backend_for(logits)
        forced_error = 0.0
    except RuntimeError:
        forced_error = 1.0
    return {
        "backend_is_torch": float(backend == "torch"),
        "fwd_err_fp64": _max_abs(logp, ref_logp),
        "bwd_err_fp64": _max_abs(x.grad, ref_grad),
        "accumulate_ok": float(bool((g1 == 2.0).all() and (g2 == 1.0).all())),
        "forced_triton_raises": forced_error,
    }


if __name__ == "__main__":
    modes = {"numerics": numerics, "aot": aot, "no-triton": no_triton}
    print(json.dumps(modes[sys.argv[1]]()))
