"""Kernel benchmarks: fused scored log-prob, fused LM head and G1/G2 accumulation against
plain torch.

    python -m perf.bench.kernels [--quick] [--device cpu|cuda] [--json OUT]

Every record has `name`, `impl`, `shape`, `time_s` (median of `reps` timed calls after one
warm-up; the impls of one op are called in turn, and `time_min_s` is the fastest),
`peak_mem_bytes`, `peak_mem_source`, `bytes_per_s` plus extras. Impls:
`plain` (the torch expression a learner would write), `fused-torch` (the package's torch
fallback), `fused-triton` (CUDA only: the Triton interpreter is not a performance path and is
never timed). `bytes_per_s` is the op's minimum memory traffic (each operand read / written
once) divided by `time_s`, the same figure for every impl of an op, so it compares equal work;
`bw_fraction` divides it by the machine's measured stream bandwidth (`stream_bandwidth`
records, the best of a large `copy_` and `add_`), and on CUDA `hbm_fraction` by the data-sheet
HBM peak. Peak memory: CUDA measures `max_memory_allocated` above what was allocated before
the call (inputs excluded, outputs included); CPU reports the bytes of the intermediates the
method materializes, computed from the shapes (`peak_mem_source: "analytic"`). Shapes a run
skips appear as records with `time_s: None` and a `skipped` reason.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import sys
import time
from typing import Callable

import torch

import tsync_mcore.kernels as K
from tsync_mcore.kernels import dispatch

__all__ = ["HBM_PEAK_BYTES_PER_S", "hbm_peak", "machine_name", "run_benchmarks", "main"]

# Data-sheet HBM bandwidth, matched as a substring of the upper-cased device name, longest first.
HBM_PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100 PCIE": 2.0e12, "H100": 3.35e12}

LOGPROB_NAMES = ("scored_logprob_fwd", "scored_logprob_fwd_bwd")
LOGPROB_SHAPES = [(1024, 32768), (1024, 151936), (8192, 32768), (8192, 151936)]
# Largest T*V a CPU run attempts (fp32 logits: 4 bytes each, plain fwd+bwd holds ~4 copies).
CPU_TV_CAP = {True: 1 << 25, False: 1 << 28}
ACCUM_NUMEL = {"cuda": 1 << 28, "cpu-quick": 1 << 24, "cpu": 1 << 25}
STREAM_NUMEL = {"cuda": 1 << 28, "cpu-quick": 1 << 24, "cpu": 1 << 26}
REPS = {"cuda": 10, "cpu-quick": 3, "cpu": 5}
# The G1/G2 ops take milliseconds: more reps buy stable ratios on a shared machine.
MIN_ACCUM_REPS = 9


def hbm_peak(device_name: str) -> float | None:
    """Data-sheet HBM bytes/s of a GPU by name, or None when unknown."""
    upper = device_name.upper()
    for key in sorted(HBM_PEAK_BYTES_PER_S, key=len, reverse=True):
        if key in upper:
            return HBM_PEAK_BYTES_PER_S[key]
    return None


def machine_name(device: str) -> str:
    dev = torch.cuda.get_device_name() if device == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    return f"{socket.gethostname()} {dev}"


@contextlib.contextmanager
def _backend(mode: str):
    """Force the kernel dispatch (TSYNC_KERNELS is read on every call)."""
    old = os.environ.get(dispatch.BACKEND_ENV)
    os.environ[dispatch.BACKEND_ENV] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(dispatch.BACKEND_ENV, None)
        else:
            os.environ[dispatch.BACKEND_ENV] = old


def _impls(device: str) -> list[tuple[str, str | None]]:
    """(impl label, TSYNC_KERNELS mode) pairs timed on this device; plain needs no mode."""
    impls = [("plain", None), ("fused-torch", "torch")]
    if device == "cuda" and dispatch.triton_available():
        impls.append(("fused-triton", "triton"))
    return impls


def _forced(mode: str | None, fn: Callable):
    """`fn` run under TSYNC_KERNELS=mode (unchanged when mode is None)."""
    if mode is None:
        return fn

    def call():
        with _backend(mode):
            return fn()

    return call


class _Timer:
    def __init__(self, device: str, reps: int):
        self.cuda = device == "cuda"
        self.reps = reps

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def medians(self, fns: dict) -> dict:
        """(median, min) seconds per call of each fn; calls interleave so load drift hits all alike."""
        for fn in fns.values():
            fn()  # warm-up: Triton compile, allocator, thread pool
        self.sync()
        times = {key: [] for key in fns}
        for _ in range(self.reps):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                self.sync()
                times[key].append(time.perf_counter() - t0)
        return {key: (statistics.median(ts), min(ts)) for key, ts in times.items()}

    def peak(self, fn: Callable[[], object], analytic: int) -> tuple[int, str]:
        """(bytes, source): measured above the current allocation on CUDA, else `analytic`."""
        if not self.cuda:
            return analytic, "analytic"
        self.sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        self.sync()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return int(peak), "measured"


def _record(name, impl, shape, times, peak, bytes_moved, **extra) -> dict:
    """`times` = (median, min) seconds; `peak` = (bytes, source)."""
    time_s, time_min_s = times
    mem, source = peak
    return {
        "name": name, "impl": impl, "shape": shape, "time_s": time_s, "time_min_s": time_min_s,
        "peak_mem_bytes": mem, "peak_mem_source": source,
        "bytes_moved": bytes_moved,
        "bytes_per_s": bytes_moved / time_s if bytes_moved and time_s else None,
        **extra,
    }  # fmt: skip


def _skipped(name, impl, shape, reason) -> dict:
    return {"name": name, "impl": impl, "shape": shape, "time_s": None, "peak_mem_bytes": None,
            "bytes_per_s": None, "skipped": reason}  # fmt: skip


# --------------------------------------------------------------------------- scored log-prob


def plain_logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the fused kernel replaces: an fp32 [T, V] log_softmax, then a gather."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(1)


def _fwd_bwd(fn, logits, targets, grad_out):
    leaf = logits.detach().requires_grad_(True)
    out = fn(leaf, targets)
    return out, torch.autograd.grad(out, leaf, grad_out)[0]


def _logprob_analytic(impl: str, bwd: bool, t: int, v: int, elem: int) -> int:
    """Bytes of [T, V]-scale intermediates each method holds at its high-water mark.

    plain: the fp32 copy (non-fp32 logits), the fp32 log_softmax output (saved for backward);
    backward adds the scattered gather grad and the log_softmax grad, both fp32 [T, V].
    fused-torch: fp32 column chunks of <= 2^24 elements (2 live in forward, 3 in backward)
    plus, with backward, the [T, V] logits grad in the logits dtype.
    """
    tv = t * v
    if impl == "plain":
        cast = 4 * tv if elem != 4 else 0
        return (12 * tv + (elem * tv if elem != 4 else 0)) if bwd else cast + 4 * tv
    chunk = 4 * t * max(1, min(v, (1 << 24) // t))
    return elem * tv + 3 * chunk if bwd else 2 * chunk


def bench_logprob(device: str, shapes, reps: int, dtype: torch.dtype, tv_cap: int | None) -> list[dict]:
    timer = _Timer(device, reps)
    out = []
    elem = torch.finfo(dtype).bits // 8
    for t, v in shapes:
        shape = {"T": t, "V": v, "dtype": str(dtype).replace("torch.", "")}
        if tv_cap is not None and t * v > tv_cap:
            reason = f"T*V={t * v} over the {device} cap {tv_cap} (time and host memory)"
            out += [_skipped(n, "all", shape, reason) for n in LOGPROB_NAMES]
            continue
        gen = torch.Generator(device=device).manual_seed(t + v)
        logits = (3 * torch.randn(t, v, generator=gen, device=device)).to(dtype)
        targets = torch.randint(0, v, (t,), generator=gen, device=device)
        grad_out = torch.randn(t, generator=gen, device=device)
        ref = plain_logprob(logits, targets)
        ref_grad = _fwd_bwd(plain_logprob, logits, targets, grad_out)[1].float()
        fns, checks = {}, {}
        for impl, mode in _impls(device):
            fn = plain_logprob if impl == "plain" else K.scored_logprob
            fwd = _forced(mode, lambda fn=fn: fn(logits, targets))
            both = _forced(mode, lambda fn=fn: _fwd_bwd(fn, logits, targets, grad_out))
            lp, grad = both()
            checks[impl] = {"max_abs_err": float((lp.detach() - ref).abs().max()),
                            "grad_max_abs_err": float((grad.float() - ref_grad).abs().max())}  # fmt: skip
            fns["scored_logprob_fwd", impl, False] = fwd
            fns["scored_logprob_fwd_bwd", impl, True] = both
        times = timer.medians(fns)
        for (name, impl, bwd), call in fns.items():
            peak = timer.peak(call, _logprob_analytic(impl, bwd, t, v, elem))
            # minimum traffic: read logits (twice with backward: lse, then the grad) + write grad
            moved = t * v * elem * (3 if bwd else 1)
            ts = times[name, impl, bwd]
            out.append(_record(name, impl, shape, ts, peak, moved, **checks[impl],
                               vs_plain=ts[0] / times[name, "plain", bwd][0]))  # fmt: skip
        del logits, ref_grad
    return out


def bench_liger(device: str, reps: int) -> list[dict]:
    """Liger's fused linear cross-entropy vs projection + fused scored log-prob (equal work)."""
    name = "linear_scored_logprob_fwd_bwd"
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # ImportError, or a broken install raising at import
        reason = f"unavailable: liger_kernel does not import ({type(exc).__name__})"
        return [_skipped(name, "liger", None, reason)]
    if device != "cuda":
        return [_skipped(name, "liger", None, "unavailable: liger_kernel needs CUDA")]
    t, h, v = 8192, 1024, 151936
    shape = {"T": t, "H": h, "V": v, "dtype": "bfloat16"}
    timer = _Timer(device, reps)
    hidden = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device=device) / h**0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (t,), device=device)
    liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def ours():
        x, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        loss = -K.scored_logprob(x @ w.T, targets).sum()
        return torch.autograd.grad(loss, (x, w))

    def theirs():
        x, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        return torch.autograd.grad(liger(w, x, targets), (x, w))

    fns = {"fused+matmul": ours, "liger": theirs}
    times = timer.medians(fns)
    out = [_record(name, impl, shape, times[impl], timer.peak(fn, 0), None) for impl, fn in fns.items()]
    out[1]["vs_ours"] = times["liger"][0] / times["fused+matmul"][0]
    return out


# --------------------------------------------------------------------------- fused LM head

# T above the learner's default chunk (1024), so the fused head runs several chunks
LM_HEAD_SHAPES = {"cuda": (8192, 1536, 151936), "cpu": (4096, 256, 32768),
                  "cpu-quick": (2048, 64, 16384)}


def bench_lm_head(device: str, size_key: str, reps: int, dtype: torch.dtype,
                  shape: tuple[int, int, int] | None = None, chunk: int = 1024) -> list[dict]:
    """Output projection + scored log-prob, forward and backward (grads of hidden and weight):
    `plain` (h @ W^T, log_softmax, gather), `unfused` (h @ W^T, then the package's scored
    log-prob: the learner with learner.fused_lm_head off) and `fused-*` (kernels/lm_head.py,
    chunk tokens at a time: the learner's default). Same work, but the fused head
    recomputes each chunk's logits in backward (one more T·H·V product)."""
    from tsync_mcore.kernels import lm_head

    name = "lm_head_fwd_bwd"
    t, h, v = shape or LM_HEAD_SHAPES[size_key]
    shape = {"T": t, "H": h, "V": v, "dtype": str(dtype).replace("torch.", ""), "chunk": chunk}
    gen = torch.Generator(device=device).manual_seed(5)
    hidden = torch.randn(t, h, generator=gen, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=gen, device=device) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (t,), generator=gen, device=device)
    grad_out = torch.randn(t, generator=gen, device=device)

    def run(score):
        x, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        logp = score(x, w)
        return (logp, *torch.autograd.grad(logp, (x, w), grad_out))

    scorers = {"plain": lambda x, w: plain_logprob(x @ w.t(), targets),
               "unfused": lambda x, w: K.scored_logprob(x @ w.t(), targets),
               "fused": lambda x, w: K.fused_lm_head_logprob(x, w, targets, chunk=chunk)}
    fns, checks = {}, {}
    ref = run(scorers["plain"])
    for impl, mode in _impls(device):
        if impl == "plain":
            fns["plain"] = lambda: run(scorers["plain"])
            continue
        for what in ("unfused", "fused"):
            label = f"{what}-{impl.split('-')[1]}"
            fns[label] = _forced(mode, lambda what=what: run(scorers[what]))
            got = fns[label]()
            checks[label] = {"max_abs_err": float((got[0] - ref[0]).detach().abs().max()),
                             "grad_max_abs_err": max(float((a.float() - b.float()).abs().max())
                                                     for a, b in zip(got[1:], ref[1:]))}
    checks["plain"] = {}
    del ref
    timer = _Timer(device, reps)
    times = timer.medians(fns)
    elem = torch.finfo(dtype).bits // 8
    analytic = {"plain": 2 * t * v * elem + 12 * t * v,  # logits + grad, fp32 log_softmax & grads
                "unfused": lm_head.unfused_peak_bytes(t, 0, v, dtype),
                "fused": lm_head.peak_bytes(t, h, v, chunk, dtype)}
    out = []
    for impl, call in fns.items():
        peak = timer.peak(call, analytic[impl.split("-")[0]])
        ts = times[impl]
        out.append(_record(name, impl, shape, ts, peak, None, **checks[impl],
                           vs_plain=ts[0] / times["plain"][0]))
    return out


# --------------------------------------------------------------------------- G1/G2 accumulation


def bench_stream(device: str, n: int, reps: int) -> list[dict]:
    """The machine's memory bandwidth: a large fp32 copy_ (2 passes) and add_ (3 passes)."""
    timer = _Timer(device, reps)
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    shape = {"numel": n, "dtype": "float32"}
    out = []
    passes = {"copy_": 2, "add_": 3}
    times = timer.medians({"copy_": lambda: b.copy_(a), "add_": lambda: a.add_(b)})
    return [_record("stream_bandwidth", impl, shape, ts, (0, "analytic"), passes[impl] * 4 * n)
            for impl, ts in times.items()]  # fmt: skip


def _accum_ops(device: str, n: int, acc_dtype: torch.dtype, grad_dtype: torch.dtype):
    """name -> (fused fn, plain fn, min bytes moved, plain temporaries in bytes, fused temporaries)."""
    g1, g2, acc = (torch.zeros(n, dtype=acc_dtype, device=device) for _ in range(3))
    grad = torch.randn(n, device=device).to(grad_dtype)
    ab, gb = torch.finfo(acc_dtype).bits // 8, torch.finfo(grad_dtype).bits // 8
    cast = ab * n if grad_dtype != acc_dtype else 0
    chunk = ab * min(n, 1 << 24)
    r, mu, scale = 0.7, 0.3, 0.125

    def plain_g1g2():
        g = grad.to(acc_dtype)
        g1.add_(g, alpha=r)
        g2.add_(g)

    return {
        "accumulate_g1g2": (lambda: K.accumulate_g1g2_(g1, g2, grad, r), plain_g1g2,
                            n * (4 * ab + gb), cast, chunk if cast else 0),
        "combine_group": (lambda: K.combine_group_(acc, g1, g2, mu, scale),
                          lambda: acc.add_(g1.sub(g2, alpha=mu).mul_(scale)), 4 * ab * n, ab * n, chunk),
        "axpy": (lambda: K.axpy_(acc, grad, r), lambda: acc.add_(grad.to(acc_dtype), alpha=r),
                 n * (2 * ab + gb), cast, chunk if cast else 0),
    }  # fmt: skip


def bench_accumulate(
    device: str, n: int, reps: int, grad_dtypes, bandwidth: float, hbm: float | None
) -> list[dict]:
    timer = _Timer(device, reps)
    out = []
    for grad_dtype in grad_dtypes:
        ops = _accum_ops(device, n, torch.float32, grad_dtype)
        shape = {"numel": n, "acc_dtype": "float32", "grad_dtype": str(grad_dtype).replace("torch.", "")}
        for name, (fused, plain, moved, plain_tmp, fused_tmp) in ops.items():
            impls = _impls(device)
            fns = {impl: plain if impl == "plain" else _forced(mode, fused) for impl, mode in impls}
            times = timer.medians(fns)
            for impl, fn in fns.items():
                peak = timer.peak(fn, plain_tmp if impl == "plain" else fused_tmp)
                ts = times[impl]
                rec = _record(name, impl, shape, ts, peak, moved, vs_plain=ts[0] / times["plain"][0])
                rec["bw_fraction"] = rec["bytes_per_s"] / bandwidth
                if hbm:
                    rec["hbm_fraction"] = rec["bytes_per_s"] / hbm
                out.append(rec)
        del ops
    return out


# --------------------------------------------------------------------------- driver


def run_benchmarks(
    device: str = "cpu",
    quick: bool = False,
    *,
    logprob_shapes: list[tuple[int, int]] | None = None,
    accum_numel: int | None = None,
    stream_numel: int | None = None,
    reps: int | None = None,
    lm_head_shape: tuple[int, int, int] | None = None,
    lm_head_chunk: int = 1024,
) -> list[dict]:
    """All kernel records for `device`; the keyword overrides shrink a run (tests)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    size_key = device if device == "cuda" or not quick else "cpu-quick"
    reps = reps or REPS[size_key]
    if logprob_shapes is None:
        logprob_shapes = LOGPROB_SHAPES[:1] if quick and device == "cpu" else LOGPROB_SHAPES
        skipped = [] if logprob_shapes is LOGPROB_SHAPES else LOGPROB_SHAPES[1:]
    else:
        skipped = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tv_cap = None if device == "cuda" else CPU_TV_CAP[quick]
    out = [_skipped(n, "all", {"T": t, "V": v}, "not in --quick (CPU quick runs T=1024, V=32768 only)")
           for t, v in skipped for n in LOGPROB_NAMES]  # fmt: skip
    out += bench_logprob(device, logprob_shapes, reps, dtype, tv_cap)
    out += bench_lm_head(device, size_key, reps, dtype, lm_head_shape, lm_head_chunk)
    out += bench_liger(device, reps)
    accum_reps = max(reps, MIN_ACCUM_REPS)
    stream = bench_stream(device, stream_numel or STREAM_NUMEL[size_key], accum_reps)
    hbm = hbm_peak(torch.cuda.get_device_name()) if device == "cuda" else None
    bandwidth = max(r["bytes_per_s"] for r in stream)
    for rec in stream:
        rec["bw_fraction"] = rec["bytes_per_s"] / bandwidth
        if hbm:
            rec["hbm_peak_bytes_per_s"] = hbm
            rec["hbm_fraction"] = rec["bytes_per_s"] / hbm
    out += stream
    grad_dtypes = [torch.float32] if quick or device == "cpu" else [torch.float32, torch.bfloat16]
    out += bench_accumulate(device, accum_numel or ACCUM_NUMEL[size_key], accum_reps, grad_dtypes,
                            bandwidth, hbm)  # fmt: skip
    return out


def result_document(kernels: list[dict], device: str, **extra) -> dict:
    """The result-file schema perf/bench/check.py reads: machine, date, overlap, kernels."""
    return {"machine": machine_name(device), "date": datetime.date.today().isoformat(),
            "overlap": [], "kernels": kernels, **extra}  # fmt: skip


def format_table(records: list[dict]) -> str:
    def fmt(x, unit=""):
        return "-" if x is None else (f"{x:.3g}{unit}" if isinstance(x, float) else str(x))

    rows = [("name", "impl", "shape", "time_s", "peak_mem", "GB/s", "vs_plain", "bw_frac")]
    for r in records:
        shape = ",".join(f"{k}={v}" for k, v in (r["shape"] or {}).items())
        if r.get("skipped"):
            rows.append((r["name"], r["impl"], shape, "skipped: " + r["skipped"], "", "", "", ""))
            continue
        gbs = r["bytes_per_s"] / 1e9 if r["bytes_per_s"] else None
        mem = r["peak_mem_bytes"] / 2**20 if r["peak_mem_bytes"] is not None else None
        rows.append((r["name"], r["impl"], shape, fmt(r["time_s"]),
                     fmt(mem, " MiB") + (" (a)" if r.get("peak_mem_source") == "analytic" else ""),
                     fmt(gbs), fmt(r.get("vs_plain")), fmt(r.get("bw_fraction"))))  # fmt: skip
    widths = [max(len(row[i]) for row in rows if len(row[i]) < 60) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CPU shapes (seconds)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="default: cuda when available, else cpu")  # fmt: skip
    ap.add_argument("--json", metavar="OUT", help="write {machine, date, overlap: [], kernels} here")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    records = run_benchmarks(device, args.quick)
    print(format_table(records))
    print("(a) = analytic peak memory (CPU: bytes of the intermediates each method materializes)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result_document(records, device), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
