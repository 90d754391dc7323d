"""GPU learner sweep: Qwen2.5-1.5B / 3B shapes, 2k-32k-token sources, GRPO sync vs thundersync
under the overlap benchmark's simulated rollout, fused LM head on and off.

    (through perf/bench/gpu_step.py: `--sweep-models 1.5b,3b`, `--skip-sweep`; dry run on CPU:
    `python -m perf.bench.gpu_step --device cpu --model tiny --skip-kernels --skip-step`)

The learner is the project's own (`Learner` over the Megatron `Policy`, one rank, bf16,
random weights written here, nothing downloaded). A cell is (model, source length T,
sources B, group size m, learner.k_open). Its batch is `perf.bench.workload.Workload`'s (the CPU overlap benchmark's
rollout model) with every source T tokens long: trajectory i completes at τ_i = U_i·R,
U_i ~ Uniform(0, 1), rewards random, groups of m. Per cell:

    warm-up       the batch under thundersync, all sources ready at once (kernels, allocator,
                  Adam state, the open groups' vectors); memory allocated after it = static
    calibration   the batch under sync, all ready: its learner time sets R = r·L
    sync, R = r·L and thundersync, R = r·L   the step times whose ratio is the speedup;
                  L = the faster of calibration and the sync run's active time
    profile       (T ≤ 8k, fused head on) thundersync again under the CUDA profiler:
                  kernel time over its unprofiled active time = device busy; host share = 1 − it

The rollout is simulated on a clock that skips the learner's idle waits: when no source is
ready the device is synchronised (queued work finishes, as it would during the wait) and
the clock jumps to the next completion, so an R-second rollout costs no real seconds. Step
time = clock time from the rollout's start (begin(), U = 0) to the end of close(), as in the
overlap benchmark (sync: R·max U_i + L); active = step − skipped idle.
MFU = ledger FLOPs (attention as executed, LM head over the positions it runs on: every
position unfused, the scored ones fused) / (active time · device peak).

Configuration keys from the fused-head and packing work (`learner.fused_lm_head`,
`learner.lm_head_chunk`, `learner.max_tokens_per_pass`) are set only where this checkout's
LearnerConfig has them; a cell records what it ran with (None: the key does not exist).
An unfused run that runs out of memory records "oom" (and the build's longer cells too).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time
from typing import Callable

import torch

from tsync_mcore.observability.ledger.flops import train_flops
from tsync_mcore.observability.ledger.mfu import Peak, mfu_active

from perf.bench.workload import Workload

__all__ = ["SWEEP_MODELS", "SWEEP_CELLS", "run_sweep", "write_random_checkpoint"]

# Qwen2.5-1.5B / -3B (config.json of the released models; qkv bias, tied embeddings).
SWEEP_MODELS = {
    "1.5b": dict(vocab_size=151936, hidden=1536, layers=28, heads=12, kv_heads=2,
                 intermediate=8960, tie=True),
    "3b": dict(vocab_size=151936, hidden=2048, layers=36, heads=16, kv_heads=2,
               intermediate=11008, tie=True),
    "tiny": dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                 tie=True),
}
# model -> [(T tokens per source, B sources, m group size, learner.k_open)], run in this
# order. About 32-64k tokens per batch; fewer sources at 32k. Each open group holds two FP32
# vectors of the parameter count (12 GB each at 3B), so k_open is small where memory is
# tight. The 3B at 32k is left out: its static state (bf16 weights, FP32 main grads, Adam,
# FP32 accumulators: ~90 GB) and 32k tokens of activations do not fit one 141 GB GPU
# without activation recompute.
SWEEP_CELLS = {
    "1.5b": [(2048, 16, 4, 2), (8192, 8, 4, 2), (32768, 2, 2, 1)],
    "3b": [(2048, 16, 4, 1), (8192, 4, 4, 1)],
    "tiny": [(64, 8, 4, 2), (128, 4, 4, 2), (256, 2, 2, 1)],
}
PROFILE_MAX_T = 8192  # host share measured where the host can matter (2k, 8k sources)
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# --------------------------------------------------------------------------- model


def write_random_checkpoint(out_dir: str, dims: dict, max_positions: int, device: str,
                            std: float = 0.02, seed: int = 0) -> str:
    """A Qwen2 config.json + one safetensors file of random bf16 weights (norms ~1 + std·N),
    drawn on `device`: a 3B model in seconds, no HF model initialisation on the host."""
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.Qwen2Config(
        vocab_size=dims["vocab_size"], hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"], num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        hidden_act="silu", max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        tie_word_embeddings=dims["tie"], rope_theta=1e6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # transformers 4 / 5
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.Qwen2ForCausalLM(cfg).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device) * std
        if name.endswith("norm.weight"):
            t += 1.0
        tensors[name] = t.to(torch.bfloat16).cpu()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out_dir)
    return out_dir


def learner_fields() -> set[str]:
    from tsync_mcore.config import LearnerConfig

    return {f.name for f in dataclasses.fields(LearnerConfig)}


def build_policy(ckpt: str, device: str, *, fused: bool | None, head_chunk: int | None,
                 max_tokens_per_pass: int | None, attention: str):
    """(Policy, its LearnerConfig, what the run used): a fresh Policy of the project's."""
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy

    fields = learner_fields()
    over = {"model.hf_dir": ckpt, "model.dtype": "bf16" if device == "cuda" else "fp32",
            "model.attention": attention, "learner.objective": "grpo",
            "learner.schedule": "thundersync",
            # whole-sequence sources: the ledger's FLOPs are what the learner runs
            "learner.shared_prefix": False}
    if fused is not None and "fused_lm_head" in fields:
        over["learner.fused_lm_head"] = fused
    if head_chunk is not None and "lm_head_chunk" in fields:
        over["learner.lm_head_chunk"] = head_chunk
    if max_tokens_per_pass is not None and "max_tokens_per_pass" in fields:
        over["learner.max_tokens_per_pass"] = max_tokens_per_pass
    cfg = load_config(None, over)
    policy = Policy(cfg)
    lc = cfg.learner
    used = {"fused_lm_head": getattr(lc, "fused_lm_head", None),
            "lm_head_chunk": getattr(lc, "lm_head_chunk", None),
            "max_tokens_per_pass": getattr(lc, "max_tokens_per_pass", None),
            "spec": cfg.model.spec, "attention": policy.attention_mode,
            "core_attention": type(policy.model.decoder.layers[0].self_attention
                                   .core_attention).__name__}
    return policy, lc, used


def _prompt_len(T: int) -> int:
    return min(256, T // 8)


def cell_flops(spec, T: int, B: int, attention: str, fused: bool | None) -> float:
    """Ledger FLOPs of one batch as executed: B sources of T tokens, the LM head over every
    position (logits path) or over the scored ones only (fused head)."""
    head = T - _prompt_len(T) if fused else T
    return train_flops(spec, [T] * B, attention=attention, logits_positions=[head] * B).total


# --------------------------------------------------------------------------- one batch


class SimClock:
    """perf_counter with the learner's idle waits skipped (see the module doc)."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.skipped = 0.0

    def now(self) -> float:
        return time.perf_counter() + self.skipped

    def wait_until(self, t: float) -> None:
        if self.now() >= t:
            return
        self.sync()  # the device drains what is queued: that overlaps the wait
        gap = t - self.now()
        if gap > 0:
            self.skipped += gap


def run_batch(learner, work: Workload, R: float, draw: int, schedule: str,
              sync: Callable[[], None]) -> dict:
    """One update of `work`'s batch `draw` with completions at U_i·R under `schedule`."""
    plan, _, items = work.update(learner.version, R, draw=draw)
    clock = SimClock(sync)
    t0 = clock.now()
    learner.begin(plan, schedule=schedule)
    for ready, src in items:
        clock.wait_until(t0 + ready)
        learner.submit(src)  # GRPO serves on arrival what the schedule releases
    result = learner.close()
    sync()
    step = clock.now() - t0
    return {"step_time_s": step, "idle_s": clock.skipped, "active_s": step - clock.skipped,
            "ok": result.summary.ok}


def device_busy_s(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Kernel and copy time of `fn` on the device (torch.profiler, as gpu_step.profile_step;
    one stream, so they do not overlap)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA) / 1e6  # µs -> s


# --------------------------------------------------------------------------- one cell


def run_cell(learner, policy, spec, model: str, T: int, B: int, m: int, *, ratio: float,
             device: str, peak: Peak, fused: bool | None, profile: bool, seed: int) -> dict:
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompt = _prompt_len(T)
    work = Workload("grpo", batch=B, group_size=m, min_len=T - prompt, max_len=T - prompt,
                    prompt_len=prompt, vocab=spec.vocab_size, seed=seed)
    flops = cell_flops(spec, T, B, policy.attention_mode, fused)
    tokens = B * T
    out: dict = {"model": model, "seq_len": T, "n_sources": B, "group_size": m,
                 "prompt_len": prompt, "tokens_per_batch": tokens, "flops_per_batch": flops,
                 "ratio": ratio}
    # warm-up under thundersync, all ready at once: kernels, allocator, Adam state and the
    # open-group vectors (pooled), so what follows measures a steady learner
    run_batch(learner, work, 0.0, 0, "thundersync", sync)
    if cuda:
        out["static_mem_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    calib = run_batch(learner, work, 0.0, 0, "sync", sync)
    R = ratio * calib["active_s"]
    runs = {}
    for schedule in ("sync", "thundersync"):
        r = run_batch(learner, work, R, 0, schedule, sync)
        r.update(mfu_active=mfu_active(flops, r["active_s"], 1, peak),
                 tokens_per_s=tokens / r["step_time_s"],
                 tokens_per_s_active=tokens / r["active_s"])
        runs[schedule] = r
    # L: the batch served under sync, all of it active (measured twice: calibration and the
    # sync run after its wait; the faster one, a first sync pass may still warm something)
    L = min(calib["active_s"], runs["sync"]["active_s"])
    out.update(L_s=L, R_s=R, mfu_active=mfu_active(flops, L, 1, peak),
               tokens_per_s_active=tokens / L, schedules=runs,
               speedup_vs_sync=runs["sync"]["step_time_s"] / runs["thundersync"]["step_time_s"])
    if cuda:
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_above_static_bytes"] = out["peak_mem_bytes"] - out["static_mem_bytes"]
    if profile and cuda:
        busy = device_busy_s(lambda: run_batch(learner, work, R, 0, "thundersync", sync), sync)
        active = runs["thundersync"]["active_s"]
        out.update(device_busy_s=busy, device_busy_fraction=busy / active,
                   host_share=max(0.0, 1.0 - busy / active))
    out["status"] = "ok"
    return out


# --------------------------------------------------------------------------- the sweep


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _estimate_s(prev: dict | None, flops: float, peak: Peak, mfu_guess: float = 0.25) -> float:
    """Real seconds a cell will take (warm-up, calibration, sync, thundersync, profile
    ≈ 5.5 L; the warm-up is slower), scaled from the last finished cell of the build, else
    from a guessed MFU."""
    if prev and prev.get("status") == "ok":
        L = prev["L_s"] * flops / prev["flops_per_batch"]
    else:
        L = flops / (mfu_guess * float(peak))
    return 5.5 * L + 5.0


def run_sweep(models: list[str], device: str, peak: Peak, *, deadline: float, ratio: float = 1.0,
              fused_modes: tuple[bool, ...] = (True, False), head_chunk: int | None = None,
              max_tokens_per_pass: int | None = None, attention: str = "auto", seed: int = 0,
              on_cell: Callable[[dict], None] = lambda c: None) -> list[dict]:
    """Every (model, fused mode, cell) in order until `deadline` (perf_counter); a cell that
    would not finish before it is recorded as skipped."""
    from tsync_mcore.learner.update import Learner
    from tsync_mcore.model.bridge import load_hf_config

    fields = learner_fields()
    if "fused_lm_head" not in fields:
        fused_modes = (None,)  # this checkout has no fused head: one variant, the logits path
    cells: list[dict] = []

    def record(cell: dict) -> None:
        cells.append(cell)
        on_cell(cell)
        state = cell["status"] if cell["status"] != "ok" else (
            f"L {cell['L_s']:.3f}s MFU {cell['mfu_active']:.1%} speedup "
            f"{cell['speedup_vs_sync']:.2f}x peak "
            f"{(cell.get('peak_mem_bytes') or 0) / 2**30:.1f} GiB"
            + (f" host {cell['host_share']:.1%}" if "host_share" in cell else ""))
        print(f"sweep {cell['model']} {cell['n_sources']}x{cell['seq_len']} fused="
              f"{cell.get('fused_lm_head')}: {state}", flush=True)

    for model in models:
        dims = SWEEP_MODELS[model]
        plan = SWEEP_CELLS[model]
        work_dir = tempfile.mkdtemp(prefix=f"tsync-sweep-{model}-")
        try:
            ckpt = None
            for fused in fused_modes:
                base = {"model": model, "dims": dims, "fused_lm_head": fused}
                if time.perf_counter() + 30 > deadline:
                    for T, B, m, k in plan:
                        record({**base, "seq_len": T, "n_sources": B, "group_size": m,
                                "k_open": k, "status": "skipped: time budget"})
                    continue
                if ckpt is None:
                    t = time.perf_counter()
                    ckpt = write_random_checkpoint(os.path.join(work_dir, "ckpt"), dims,
                                                   max(c[0] for c in plan), device, seed=seed)
                    print(f"sweep {model}: random checkpoint in {time.perf_counter() - t:.1f}s",
                          flush=True)
                spec = load_hf_config(ckpt)
                t = time.perf_counter()
                policy, lc, used = build_policy(
                    ckpt, device, fused=fused, head_chunk=head_chunk,
                    max_tokens_per_pass=max_tokens_per_pass, attention=attention)
                base.update(used, build_s=time.perf_counter() - t,
                            params=sum(p.numel() for p in policy.model.parameters()))
                prev, failed = None, None
                for T, B, m, k in plan:
                    cell = {**base, "seq_len": T, "n_sources": B, "group_size": m, "k_open": k}
                    flops = cell_flops(spec, T, B, policy.attention_mode, fused)
                    need = _estimate_s(prev, flops, peak)
                    if failed:
                        record({**cell, "status": failed})
                        continue
                    if time.perf_counter() + need > deadline:
                        record({**cell, "status": f"skipped: time budget (needs ~{need:.0f}s)"})
                        continue
                    t = time.perf_counter()
                    learner = Learner(dataclasses.replace(lc, k_open=k), policy)
                    try:
                        cell.update(run_cell(learner, policy, spec, model, T, B, m, ratio=ratio,
                                             device=device, peak=peak, fused=fused,
                                             profile=bool(fused) and T <= PROFILE_MAX_T,
                                             seed=seed))
                    except OOM as e:
                        cell.update(status="oom", error=str(e).split("\n")[0][:300])
                        failed = f"oom (skipped: the {T}-token cell of this build ran out)"
                    if failed:  # outside the handler: its traceback no longer pins tensors
                        learner.abort()
                    del learner  # its open-group vectors with it
                    _free(device)
                    cell["wall_s"] = time.perf_counter() - t
                    record(cell)
                    prev = cell
                del policy
                _free(device)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    return cells


def summary_table(cells: list[dict]) -> str:
    """Markdown rows for perf/README.md."""
    rows = ["| model | sources × tokens | fused head | trainer MFU (active) | tokens/s (active) "
            "| host share | peak memory | speedup over sync (r = 1) |",
            "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        head = {True: "on", False: "off", None: "n/a"}[c.get("fused_lm_head")]
        shape = f"{c['n_sources']} × {c['seq_len']}"
        if c.get("status") != "ok":
            rows.append(f"| {c['model']} | {shape} | {head} | {c.get('status')} | | | | |")
            continue
        host = f"{c['host_share']:.1%}" if "host_share" in c else "–"
        mem = f"{c['peak_mem_bytes'] / 1e9:.1f} GB" if c.get("peak_mem_bytes") else "–"
        rows.append(f"| {c['model']} | {shape} | {head} | {c['mfu_active']:.1%} | "
                    f"{c['tokens_per_s_active']:.0f} | {host} | {mem} | "
                    f"{c['speedup_vs_sync']:.2f}× |")
    return "\n".join(rows)


if __name__ == "__main__":  # pretty-print a result file's sweep: python -m perf.bench.gpu_sweep R.json
    import sys

    with open(sys.argv[1]) as f:
        print(summary_table(json.load(f).get("sweep") or []))
