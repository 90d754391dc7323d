"""One-GPU benchmark: kernels at real sizes, learner steps of a ~0.5B Qwen2-shaped model, then
the learner sweep (perf/bench/gpu_sweep.py: Qwen2.5-1.5B/3B shapes, 2k-32k-token sources, GRPO
sync vs thundersync at r = 1, fused LM head on and off).

    python -m perf.bench.gpu_step [--json OUT] [--backend auto|megatron|hf] [--skip-kernels]
                            [--skip-step] [--skip-sweep] [--sweep-models 1.5b,3b]
    (normally through perf/gpu.sh)

The model is built here with random weights (`make_tiny_checkpoint`, Qwen2.5-0.5B dims:
hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864, vocab 151936, tied: 494M
parameters); nothing is downloaded. One learner step = one group of `--sources` trajectories
of `--seq-len` tokens (the second half scored), each: forward, fused scored log-prob,
backward, fold into FP32 G1/G2; then the group combination, global-norm clip, one AdamW step.

Backends: `megatron` runs the learner's own `Policy` (Megatron-Core, TE layer spec when
transformer_engine imports, else the local spec); `hf` (used when megatron.core does not
import) is a proxy of the same shapes on Hugging Face transformers: per-parameter bf16 grads
are copied into one FP32 flat buffer per source (Megatron's main-grad fold), then the same
kernels and an AdamW step. MFU = ledger `train_flops` / (step time · peak); peak memory is
`torch.cuda.max_memory_allocated` over one step. The sweep needs the megatron backend (it
runs the project's Learner); the whole run stops starting cells at `--budget-s` and writes
the result file after every sweep cell. Without CUDA it says so and exits 0
(`--device cpu --model tiny` is a dry run of the code path, sweep included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

import tsync_mcore.kernels as K
from tsync_mcore.observability.ledger.flops import train_flops
from tsync_mcore.observability.ledger.mfu import detect_peak, mfu_active

from perf import RESULTS
from perf.bench import gpu_sweep
from perf.bench import kernels as kbench

MODELS = {
    "0.5b": dict(vocab_size=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, tie=True),
    "tiny": dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tie=True),
}
NO_GPU = "no CUDA GPU: torch.cuda.is_available() is False; skipping the GPU benchmarks"


def make_checkpoint(out_dir: str, model: str, seq_len: int) -> str:
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(out_dir, arch="qwen2", dtype=torch.bfloat16, init_std=0.02, **MODELS[model])
    # why: make_tiny_checkpoint writes 512 positions; RoPE needs nothing more, the config should agree
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], seq_len)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return out_dir


def ledger_spec(ckpt: str) -> SimpleNamespace:
    """The shape facts `train_flops` reads, from config.json (no megatron import needed)."""
    with open(os.path.join(ckpt, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    return SimpleNamespace(
        vocab_size=c["vocab_size"], hidden=c["hidden_size"], layers=c["num_hidden_layers"],
        heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, ffn=c["intermediate_size"],
        tie=bool(c.get("tie_word_embeddings")), qkv_bias=c["model_type"] == "qwen2",
        qk_norm=c["model_type"] == "qwen3",
    )  # fmt: skip


def make_sources(n: int, seq_len: int, vocab: int, device: str, seed: int = 0) -> list[dict]:
    """One group: tokens, scored positions (second half), reward, as the learner receives them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq_len,), generator=gen)
        mask = [0] * (seq_len // 2) + [1] * (seq_len - seq_len // 2)
        out.append({"ids": ids.to(device), "tokens": ids.tolist(), "mask": mask,
                    "pos": torch.arange(seq_len // 2, seq_len, device=device),
                    "reward": float(torch.rand((), generator=gen))})  # fmt: skip
    return out


class GroupSums:
    """FP32 G1/G2 and the batch accumulator over a list of flat buffers, via the kernels."""

    def __init__(self, like: list[torch.Tensor]):
        self.g1 = [torch.zeros_like(b, dtype=torch.float32) for b in like]
        self.g2 = [torch.zeros_like(b, dtype=torch.float32) for b in like]
        self.acc = [torch.zeros_like(b, dtype=torch.float32) for b in like]

    def fold(self, grads: list[torch.Tensor], r: float) -> None:
        for a1, a2, g in zip(self.g1, self.g2, grads):
            K.accumulate_g1g2_(a1, a2, g, r)

    def close_group(self, mu: float, scale: float) -> list[torch.Tensor]:
        for acc, a1, a2 in zip(self.acc, self.g1, self.g2):
            K.combine_group_(acc, a1, a2, mu, scale)
            a1.zero_()
            a2.zero_()
        return self.acc

    def reset(self) -> None:
        for acc in self.acc:
            acc.zero_()


def megatron_step_fn(ckpt: str, sources: list[dict], device: str, attention: str = "auto"):
    """(step fn, description, attention mode) on the learner's own Megatron Policy."""
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy

    dtype = "bf16" if device == "cuda" else "fp32"
    # shared_prefix off: whole-sequence steps only, so spec auto may pick TE (config.resolve)
    policy = Policy(load_config(None, {"model.hf_dir": ckpt, "model.dtype": dtype,
                                       "model.attention": attention,
                                       "learner.shared_prefix": False}))
    te = device == "cuda" and _imports("transformer_engine.pytorch")  # as bridge picks the spec
    sums = GroupSums(policy.grad_buffers())
    mu = statistics.mean(s["reward"] for s in sources)
    weight = 1.0 / (len(sources) * len(sources[0]["pos"]))

    def step() -> None:
        for s in sources:
            policy.backward_source(s["tokens"], s["mask"], weight)
            sums.fold(policy.grad_buffers(), s["reward"])
            policy.zero_grads()
        policy.apply_and_step(sums.close_group(mu, 1.0), 1.0)
        sums.reset()

    import megatron.core

    core = type(policy.model.decoder.layers[0].self_attention.core_attention).__name__
    desc = (f"megatron-core {megatron.core.__version__} ({'te' if te else 'local'} spec, {core}), "
            "tsync_mcore Policy")
    return step, desc, policy.attention_mode


def hf_step_fn(ckpt: str, sources: list[dict], device: str):
    """(step fn, description, attention mode): the same step on HF transformers (proxy)."""
    import transformers

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).to(device=device, dtype=dtype)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    views = flat.split([p.numel() for p in params])
    sums = GroupSums([flat])
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    mu = statistics.mean(s["reward"] for s in sources)
    weight = 1.0 / (len(sources) * len(sources[0]["pos"]))

    def step() -> None:
        for s in sources:
            logits = model(input_ids=s["ids"][None]).logits[0]
            logp = K.scored_logprob(logits[s["pos"] - 1], s["ids"][s["pos"]])
            (-weight * logp.sum()).backward()
            for v, p in zip(views, params):  # Megatron's main-grad fold: bf16 grad -> fp32 buffer
                v.copy_(p.grad.view(-1))
                p.grad = None
            sums.fold([flat], s["reward"])
        acc = sums.close_group(mu, 1.0)[0]
        for v, p in zip(acc.split([p.numel() for p in params]), params):
            p.grad = v.view_as(p).to(p.dtype)  # a descent direction: the loss was -w·logp
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums.reset()

    attn = getattr(model.config, "_attn_implementation", "sdpa")
    desc = (f"hf-transformers {transformers.__version__} proxy (attn {attn}): megatron-core not used; "
            "same shapes, kernels, FP32 G1/G2 and AdamW step")  # fmt: skip
    return step, desc, "causal"


def _imports(module: str) -> bool:
    try:
        __import__(module)
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def learner_step(args, device: str) -> dict:
    t0 = time.perf_counter()
    ckpt = args.ckpt or make_checkpoint(tempfile.mkdtemp(prefix="tsync-gpu-step-"), args.model, args.seq_len)
    spec = ledger_spec(ckpt)
    sources = make_sources(args.sources, args.seq_len, spec.vocab_size, device)
    backend = args.backend
    if backend == "auto":
        backend = "megatron" if _imports("megatron.core") else "hf"
    build = megatron_step_fn if backend == "megatron" else hf_step_fn
    extra = {"attention": args.attention} if backend == "megatron" else {}
    step, desc, attention = build(ckpt, sources, device, **extra)
    setup_s = time.perf_counter() - t0
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()  # warm-up: kernels compile, allocator settles, optimizer state exists
    sync()
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    step_time = statistics.median(times)
    profile = profile_step(step, sync, cuda, step_time) if args.profile else None
    flops = train_flops(spec, [args.seq_len] * args.sources, attention=attention)
    peak = detect_peak(device=device)
    return {
        "backend": backend, "description": desc,
        "model": {"dims": args.ckpt or MODELS[args.model], "params": param_count(spec)},
        "n_sources": args.sources, "seq_len": args.seq_len,
        "scored_tokens": args.sources * (args.seq_len - args.seq_len // 2),
        "setup_s": setup_s, "step_time_s": step_time, "step_times_s": times,
        "tokens_per_s": args.sources * args.seq_len / step_time,
        "flops_per_step": flops.total, "attention": attention,
        "mfu_active": mfu_active(flops.total, step_time, 1, peak), **peak.to_dict(),
        "peak_mem_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "kernel_backend": K.backend_for(torch.empty(0, device=device)),
        **({"profile": profile} if profile else {}),
    }  # fmt: skip


def profile_step(step, sync, cuda: bool, step_time: float, top: int = 25) -> dict:
    """One step under torch.profiler: the ops that take the time, and the device-busy
    fraction (kernel/copy time over the unprofiled step time: the profiler slows the host)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        sync()
    wall = time.perf_counter() - t
    dev = "device" if cuda else "cpu"
    key = f"self_{dev}_time_total"
    avgs = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    print(prof.key_averages().table(sort_by=key, row_limit=top))
    # why: a CPU op's self device time is its kernels' time again; count device events only
    # (on CPU each op's self CPU time once)
    own = [e for e in avgs if (e.device_type != DeviceType.CPU) == cuda]
    busy = sum(getattr(e, key, 0.0) for e in own) / 1e6  # µs -> s
    return {"wall_s": wall, f"{dev}_busy_s": busy, "busy_fraction": busy / step_time,
            "top": [{"name": e.key, "self_s": getattr(e, key, 0.0) / 1e6, "calls": e.count}
                    for e in avgs[:top]]}  # fmt: skip


def param_count(spec) -> int:
    """Parameters of a Qwen2/Llama-family model (embedding, layers, final norm)."""
    h, hd = spec.hidden, spec.head_dim
    qkv = h * (spec.heads + 2 * spec.kv_heads) * hd + (spec.heads + 2 * spec.kv_heads) * hd * spec.qkv_bias
    layer = qkv + spec.heads * hd * h + 3 * h * spec.ffn + 2 * h
    emb = spec.vocab_size * h
    return emb * (1 if spec.tie else 2) + spec.layers * layer + h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="OUT", help="default perf/results/<date>-<host>-gpu.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="0.5b")
    ap.add_argument("--ckpt", help="use this HF checkpoint dir instead of building one")
    ap.add_argument("--backend", choices=("auto", "megatron", "hf"), default="auto")
    ap.add_argument("--sources", type=int, default=16, help="trajectories in the group")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    ap.add_argument("--attention", choices=("auto", "sdpa", "megatron"), default="auto",
                    help="megatron local spec's core attention (auto: SDPA on GPU)")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile one more step: busy fraction, top ops")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--sweep-models", default=None,
                    help="comma list of " + ",".join(gpu_sweep.SWEEP_MODELS)
                    + " (default: 1.5b,3b; tiny with --model tiny)")
    ap.add_argument("--sweep-fused", default="on,off",
                    help="fused LM head modes to sweep, where the config has learner.fused_lm_head")
    ap.add_argument("--ratio", type=float, default=1.0, help="sweep: r = R / L")
    ap.add_argument("--lm-head-chunk", type=int, default=None,
                    help="sweep: learner.lm_head_chunk (default: the config's)")
    ap.add_argument("--max-tokens-per-pass", type=int, default=None,
                    help="sweep: learner.max_tokens_per_pass (default: the config's)")
    ap.add_argument("--budget-s", type=float, default=440.0,
                    help="no sweep cell starts that would end after this many seconds")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    models = (args.sweep_models or ("tiny" if args.model == "tiny" else "1.5b,3b")).split(",")
    unknown = [m for m in models if m not in gpu_sweep.SWEEP_MODELS]
    if unknown:
        ap.error(f"--sweep-models: unknown {unknown}")
    if any(x not in ("on", "off") for x in args.sweep_fused.split(",")):
        ap.error(f"--sweep-fused: a comma list of on, off; got {args.sweep_fused!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    if args.device == "cpu" and args.model != "tiny" and not args.ckpt:
        ap.error("--device cpu is a dry run: use --model tiny")
    date, host = datetime.date.today().isoformat(), socket.gethostname()
    out = args.json or os.path.join(RESULTS, f"{date}-{host}-gpu.json")
    records, step = [], None
    if not args.skip_kernels:
        t0 = time.perf_counter()
        records = kbench.run_benchmarks(args.device, quick=args.device == "cpu")
        print(kbench.format_table(records))
        print(f"kernels: {time.perf_counter() - t0:.1f} s")
    failed = False
    if not args.skip_step:
        try:
            step = learner_step(args, args.device)
            print("learner step:", json.dumps(step, indent=1))
        except Exception as e:  # the kernel records above are still worth writing
            failed = True
            step = {"backend": args.backend, "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-4000:]}
            print(f"learner step failed ({args.backend} backend):\n{step['traceback']}", file=sys.stderr)
    doc = kbench.result_document(records, args.device, step=step)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write = lambda: _write(out, doc)  # noqa: E731
    write()
    megatron_used = step is not None and step.get("backend") == "megatron"
    if not args.skip_sweep:
        if args.backend == "hf" or not _imports("megatron.core"):
            doc["sweep_note"] = ("sweep skipped: it runs the project's Learner, which needs "
                                 "megatron-core (perf/README.md: the wheel that travels)")
            print(doc["sweep_note"])
        else:
            doc["sweep"] = []
            if step is not None:  # the 0.5B step's Policy is gone: free its memory first
                import gc
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()

            def on_cell(cell: dict) -> None:
                doc["sweep"].append(cell)
                write()

            modes = tuple({"on": True, "off": False}[x] for x in args.sweep_fused.split(","))
            try:
                gpu_sweep.run_sweep(
                    models, args.device, detect_peak(device=args.device),
                    deadline=start + args.budget_s, ratio=args.ratio, fused_modes=modes,
                    head_chunk=args.lm_head_chunk, max_tokens_per_pass=args.max_tokens_per_pass,
                    attention=args.attention, on_cell=on_cell)
                megatron_used = True
                print(gpu_sweep.summary_table(doc["sweep"]))
            except Exception as e:  # the cells so far are written; say what stopped it
                failed = True
                doc["sweep_error"] = f"{type(e).__name__}: {e}"
                doc["sweep_traceback"] = traceback.format_exc()[-4000:]
                print(f"sweep failed:\n{doc['sweep_traceback']}", file=sys.stderr)
            write()
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")
    if not failed and megatron_used and args.device != "cpu":
        from tsync_mcore.model.parallel import destroy_parallel

        # NCCL wants an explicit teardown after a clean finish; gloo's is at exit (and a
        # CPU dry run inside a test process must leave the session's groups alone)
        destroy_parallel()
    return 1 if failed else 0


def _write(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)

if __name__ == "__main__":
    sys.exit(main())
