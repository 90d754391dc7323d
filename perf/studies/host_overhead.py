"""Host cost of serving one source: aten ops dispatched, synchronising calls, host µs.

    python -m perf.studies.host_overhead [--models tiny,depth24,small] [--batches 3] [--out X.json]

For each model × objective × schedule the learner serves a warm-up batch, one batch under
`ledger.host.HostCounter` counting ops (its dispatch mode costs ~10 µs per op, so that pass
is not timed) and `--batches` batches timed with nothing but the counter's interceptions.
Per served source (its `Learner.serve_pass` and `submit`): ops dispatched, synchronising calls,
host µs (the serving thread's CPU time, median over the timed batches) and host µs per op;
per update: the same for `begin` and `close` less their serving. The sources are the overlap
benchmark's (perf/bench/workload.py `Workload`: groups of 4 sharing a 16-token prompt, 24-192
token bodies; OPD: 4 turns), the same batch every time.

Models (random Qwen2 weights, fp32, made here): `tiny` (2 layers, hidden 64, vocab 256),
`depth24` (the same widths at Qwen2.5-0.5B's 24 layers: its op count per source is the
0.5B model's), `small` (4 layers, hidden 256, vocab 4096). On a CPU the host time includes
the kernels' own work; on the tiny models it is nearly all framework overhead (Python,
dispatch, autograd), which is what a GPU run pays per op on the host. One intra-op thread
(`--threads`), so the figure is one core's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch

from perf import RESULTS

MODELS = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=256),
    "depth24": dict(hidden=64, layers=24, heads=4, kv_heads=2, intermediate=128,
                    vocab_size=256),
    "small": dict(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=704,
                  vocab_size=4096),
}
CASES = [("grpo", "sync"), ("grpo", "thundersync"), ("opd", "sync"), ("opd", "thundersync")]


def learner(hf_dir: str, par, objective: str, schedule: str):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.update import Learner
    from tsync_mcore.learner.policy import Policy
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-5,
                             "learner.objective": objective, "learner.schedule": schedule})
    return Learner(cfg.learner, Policy(cfg, par=par))


def serve(l, work, counter=None) -> None:
    """One update of the workload's batch (draw 0) through the learner's entry points."""
    plan, n_turns, items = work.update(l.version, 0.0, draw=0)
    plan.n_turns = n_turns
    watch = counter.watch(l) if counter is not None else None
    if watch is not None:
        watch.__enter__()
    try:
        l.begin(plan)
        for _, src in items:
            # GRPO: each source served as it arrives (one per pass); OPD: every turn first
            l.submit(src, serve=l.cfg.objective == "grpo")
        l.close()
    finally:
        if watch is not None:
            watch.__exit__(None, None, None)


def measure(hf_dir: str, par, model: str, objective: str, schedule: str, batches: int,
            batch: int, cuda_sync_debug: bool) -> dict:
    from perf.bench.workload import Workload
    from tsync_mcore.observability.ledger.host import HostCounter
    work = Workload(objective, batch=batch, vocab=MODELS[model]["vocab_size"])
    l = learner(hf_dir, par, objective, schedule)
    serve(l, work)  # warm-up
    with HostCounter(ops=True, cuda_sync_debug=cuda_sync_debug) as counted:
        serve(l, work, counted)
    timed = []
    for _ in range(batches):
        with HostCounter(ops=False) as hc:
            serve(l, work, hc)
        timed.append(hc.per_source())
    c = counted.per_source()
    host_us = statistics.median(t["host_us"] for t in timed)
    row = dict(model=model, objective=objective, schedule=schedule, sources=c["sources"],
               ops_per_source=round(c["ops"], 1), syncs_per_source=c["syncs"],
               max_source_syncs=c["max_source_syncs"],
               host_us_per_source=round(host_us, 1),
               host_us_per_op=round(host_us / c["ops"], 2) if c["ops"] else None,
               batch_ops=c["batch_ops"], batch_syncs=c["batch_syncs"],
               batch_host_us=round(statistics.median(t["batch_host_us"] for t in timed), 1),
               top_ops_per_source=top_ops(counted, c["sources"]),
               sync_sites=dict(counted.sync_sites()),
               batch_sync_sites=dict(counted.sync_sites(("begin", "close"))))
    if cuda_sync_debug:
        row["cuda_sync_warnings_per_source"] = sum(
            counted.sections.get(s).cuda_syncs for s in ("serve", "submit")
            if s in counted.sections) / max(c["sources"], 1)
    return row


def top_ops(counter, n: int, k: int = 12) -> dict:
    """The k most dispatched aten ops per served source."""
    from collections import Counter
    ops = Counter()
    for name in ("serve", "submit"):
        if name in counter.sections:
            ops.update(counter.sections[name].by_op)
    return {op: round(c / max(n, 1), 1) for op, c in ops.most_common(k)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,depth24,small")
    p.add_argument("--batches", type=int, default=3, help="timed batches per cell")
    p.add_argument("--batch", type=int, default=16, help="trajectories per batch")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--cuda-sync-debug", action="store_true",
                   help="also count torch's own sync warnings (CUDA only)")
    p.add_argument("--out", default=None, help="default perf/results/<date>-<vm|gpu>-host.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tsync_mcore.model.parallel import init_parallel
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    par = init_parallel(tp_size=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            if model not in MODELS:
                p.error(f"--models: unknown model {model!r} (have {sorted(MODELS)})")
            hf_dir = make_tiny_checkpoint(os.path.join(tmp, model), arch="qwen2",
                                          **MODELS[model])
            for objective, schedule in CASES:
                row = measure(hf_dir, par, model, objective, schedule, args.batches,
                              args.batch, args.cuda_sync_debug)
                rows.append(row)
                print(f"{model:8s} {objective:4s} {schedule:11s} ops/src "
                      f"{row['ops_per_source']:7.1f}  syncs/src {row['syncs_per_source']:.2f}  "
                      f"host µs/src {row['host_us_per_source']:9.1f}  µs/op "
                      f"{row['host_us_per_op']:6.2f}  per update: syncs {row['batch_syncs']}",
                      flush=True)
    gpu = torch.cuda.is_available()
    result = dict(date_utc=time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                  host=socket.gethostname(),
                  device=torch.cuda.get_device_name(0) if gpu else f"cpu x{os.cpu_count()}",
                  torch=torch.__version__, threads=args.threads, batch=args.batch,
                  batches=args.batches, rows=rows)
    out = args.out or os.path.join(RESULTS,
                                   f"{time.strftime('%Y%m%d')}-{'gpu' if gpu else 'vm'}-host.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
