"""Publication time and bytes per update: publish.method file vs dist vs dist + delta.

One vLLM engine (the rollout) and a sender in this process (learner rank 0), on the real
paths: `file` writes the HF-named safetensors file to /dev/shm as publish.write does and
the engine reloads it (RolloutEngine.reload_weights); `dist` broadcasts the same tensors
over the publication group (publish_dist.Sender) while the engine receives them
(RolloutEngine.receive_weights); `dist+delta` does so with publish.delta. Every update
changes θ as an Adam step of size `--lr` per element would (θ − lr·sign(noise), in the
publication dtype), so the bf16 share of changed elements is realistic for that lr.
The time is the learner's: from the start of the publication to the engine's return
(what publish_time_s measures, minus the export both methods share).

    python -m perf.studies.run_publish                 # Qwen2.5-0.5B shapes, bf16
    python -m perf.studies.run_publish --tiny          # a seconds-long smoke run
    python -m perf.studies.run_publish --dtype fp32 --out perf/results/x.json

On a GPU machine the engine runs on the GPU; the group is gloo (the sender's tensors on
the CPU) unless `--backend nccl` and the sender has a GPU of its own (NCCL cannot pair two
processes on one device).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import tempfile
import threading
import time

from perf import RESULTS

# Qwen2.5-0.5B: vocab 151936, hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, tied
QWEN25_05B = dict(arch="qwen2", vocab_size=151936, hidden=896, layers=24, heads=14, kv_heads=2,
                  intermediate=4864, tie=True)
TINY = dict(arch="qwen2", vocab_size=300, hidden=64, layers=2, heads=2, kv_heads=2,
            intermediate=128, tie=True)


def make_model(out: str, shapes: dict, dtype) -> str:
    """Random weights with the shapes (HF init, std 0.02 as the real model's), no download."""
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    if not os.path.exists(os.path.join(out, "config.json")):
        make_tiny_checkpoint(out, dtype=dtype, init_std=0.02, **shapes)
    return out


def step(theta: dict, lr: float, gen) -> dict:
    """One Adam-like update: every element moves by lr (sign random), then rounds to the
    publication dtype: in bf16 most of them round back to where they were."""
    import torch

    return {k: (t.float() - lr * torch.randn(t.shape, generator=gen).sign()).to(t.dtype)
            for k, t in theta.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=5, help="updates timed per method")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--lr", type=float, default=1e-6, help="per-element step of an update")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--dense", type=float, default=0.25, help="publish.delta_dense")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke run)")
    ap.add_argument("--model-dir", default="", help="where the random model is made/reused")
    ap.add_argument("--out", default="", help="results JSON (default perf/results/"
                                               "<date>-<host>-publish.json)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    from tsync_mcore.publication import dist as pd
    from tsync_mcore.rollout.engine import EngineThread, RolloutEngine

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    shapes = TINY if args.tiny else QWEN25_05B
    tag = "tiny" if args.tiny else "qwen2.5-0.5b"
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(),
                                               f"tsync-publish-{tag}-{args.dtype}")
    t0 = time.perf_counter()
    make_model(model_dir, shapes, dtype)
    print(f"model {model_dir} ready in {time.perf_counter() - t0:.1f}s", flush=True)
    theta = {k: v for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    n_bytes = sum(t.numel() * t.element_size() for t in theta.values())

    et = EngineThread()
    gpu = torch.cuda.is_available()

    async def make():
        return RolloutEngine(model_dir, max_model_len=256, seed=0, kv_cache_gib=1.0,
                             dtype={"bf16": "bfloat16", "fp32": "float32"}[args.dtype],
                             max_num_seqs=8, gpu_memory_utilization=0.3 if gpu else None)

    t0 = time.perf_counter()
    engine = et.run(make())
    print(f"engine up in {time.perf_counter() - t0:.1f}s", flush=True)

    store = pd.host_store("127.0.0.1", 0, 600)
    token, out = secrets.token_hex(8), {}
    th = threading.Thread(target=lambda: out.update(pg=pd.join_group(
        "127.0.0.1", store.port, 0, 2, token=token, timeout_s=600, backend=args.backend)))
    th.start()
    et.run(engine.join_publish_group("127.0.0.1", store.port, 1, 2, token=token, timeout_s=600,
                                     backend=args.backend))
    th.join()
    pg = out["pg"]
    params = pd.params_of(theta.items())
    bucket_bytes = int(args.bucket_mb * 2**20)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(shm, f"tsync-publish-bench-{os.getpid()}.safetensors")

    def publish_file(version, th_):
        t = time.perf_counter()
        tmp = path + ".tmp"
        save_file({k: v.contiguous() for k, v in th_.items()}, tmp)
        os.replace(tmp, path)
        et.run(engine.reload_weights(path, version=version))
        return time.perf_counter() - t, os.path.getsize(path), None

    def publish_dist(sender):
        def go(version, th_):
            res = {}
            t = time.perf_counter()
            snd = threading.Thread(target=lambda: res.update(st=sender.publish(
                version, th_.items())))
            snd.start()
            from tsync_mcore.channel import Publish
            et.run(engine.receive_weights(Publish(version=version, path="", method="dist",
                                                  n_buckets=len(sender.buckets),
                                                  delta=sender.delta)))
            snd.join()
            seconds = time.perf_counter() - t
            st = res["st"]
            if sender.delta:
                assert engine.checksums == [st.checksum], "replica checksum differs"
            return seconds, st.bytes, st
        return go

    methods = {
        "file": publish_file,
        "dist": publish_dist(pd.Sender(pg, params, bucket_bytes, backend=args.backend)),
        "dist+delta": publish_dist(pd.Sender(pg, params, bucket_bytes, backend=args.backend,
                                             delta=True, dense_frac=args.dense)),
    }
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    version = 0
    # The first publication of each method (delta: its whole base) is not timed, then the
    # methods take turns on the same θ sequence, so machine drift hits them alike.
    for m, fn in methods.items():
        version += 1
        fn(version, theta)
    digest0 = et.run(engine.param_digest())
    for u in range(args.updates):
        theta = step(theta, args.lr, gen)
        for m, fn in methods.items():
            version += 1
            seconds, sent, st = fn(version, theta)
            row = {"update": u, "publish_s": seconds, "bytes": sent}
            if st is not None and st.elements:
                row["changed_share"] = st.changed / st.elements
                row["sparse_buckets"] = st.sparse_buckets
                row["buckets"] = st.buckets
            rows[m].append(row)
            print(f"update {u} {m:10s} {seconds:7.3f}s {sent / 2**20:9.1f} MiB"
                  + (f"  changed {row['changed_share']:.4f}" if "changed_share" in row
                     and m == "dist+delta" else ""), flush=True)
        # every method left the engine with the same weights
    digest = et.run(engine.param_digest())
    assert digest != digest0 or args.lr == 0
    summary = {}
    for m, rs in rows.items():
        summary[m] = {"publish_s_median": statistics.median(r["publish_s"] for r in rs),
                      "bytes_median": statistics.median(r["bytes"] for r in rs)}
        if m == "dist+delta":
            summary[m]["changed_share_median"] = statistics.median(r["changed_share"] for r in rs)
    f = summary["file"]
    ratios = {f"file/{m}_time": f["publish_s_median"] / summary[m]["publish_s_median"]
              for m in ("dist", "dist+delta")}
    ratios.update({f"file/{m}_bytes": f["bytes_median"] / summary[m]["bytes_median"]
                   for m in ("dist", "dist+delta")})
    ratios["dist/dist+delta_time"] = (summary["dist"]["publish_s_median"]
                                      / summary["dist+delta"]["publish_s_median"])
    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "host": socket.gethostname(), "machine": platform.machine(),
        "device": torch.cuda.get_device_name(0) if gpu else f"cpu x{os.cpu_count()}",
        "model": tag, "model_bytes": n_bytes, "dtype": args.dtype, "lr": args.lr,
        "bucket_mb": args.bucket_mb, "dense_frac": args.dense, "backend": args.backend,
        "updates": args.updates, "summary": summary, "ratios": ratios, "rows": rows,
    }
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1))
    out_path = args.out or os.path.join(
        RESULTS,
        f"{time.strftime('%Y%m%d')}-{'gpu' if gpu else 'vm'}-publish.json")
    if not args.tiny or args.out:
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        with open(out_path, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {out_path}")
    os.remove(path)
    et.run(engine.aclose())
    et.close()


if __name__ == "__main__":
    main()
