"""CLI for the overlap benchmark: `python -m perf.bench.run [--quick] --out FILE.json`."""

import argparse
import json
import os
import sys
import tempfile

from tsync_mcore.channel.link import realtime_io_permitted
from tsync_mcore.observability.trace import TraceError

from perf.bench.analysis import mark_busy_host
from perf.bench.cell import HostSetup, cell
from perf.bench.model import bench_model
from perf.bench.plan import PACK_DEFAULT, SCHEDULES
from perf.bench.workload import RecordedWorkload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="r = 1 and one batch size only")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default=None, help="directory for the runs (default: a temp dir)")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds per cell; each plays one batch under every schedule")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help="comma list, sync included (default: all five); an asynchronous one "
                        "plays a segment of 4 updates per round, the last 2 measured")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="fully_async: learner.max_staleness, the policy lag bound (default 1)")
    p.add_argument("--objectives", default="grpo,opd")
    p.add_argument("--normal-sched", action="store_true",
                   help="learners under SCHED_OTHER (default: SCHED_BATCH, see perf.bench.cell.HostSetup)")
    p.add_argument("--no-realtime-io", action="store_true",
                   help="simulator and channel threads without SCHED_FIFO (default: with it "
                        "where permitted)")
    p.add_argument("--no-pin", action="store_true", help="do not pin learner rank i to core i")
    p.add_argument("--ratios", default=None, help="comma list (default: 1 quick, 0.5,1,2 full)")
    p.add_argument("--batches", default=None, help="comma list (default: 64 quick, 64,128 full)")
    p.add_argument("--release-trace", metavar="RUN_DIR", default=None,
                   help="replay a real run's release trace (a learner run.dir: traces/ and "
                        "metrics.jsonl) instead of the paper's model; objective and batch come from it")
    p.add_argument("--max-tokens-per-pass", type=int, default=PACK_DEFAULT,
                   help="learner.max_tokens_per_pass: sources packed per forward/backward "
                        f"(default {PACK_DEFAULT}: sync packs its micro-batches like verl/slime; "
                        "0: one source per pass)")
    p.add_argument("--minibatches", default="1",
                   help="comma list of learner.minibatches (PPO mini-batch steps per update; "
                        "one cell each, e.g. 1,2,4: what streaming still saves at m > 1)")
    p.add_argument("--routing", default="balanced", choices=["balanced", "static"],
                   help="GRPO: trajectory → least-loaded rank (default) or group → fixed rank")
    p.add_argument("--trace-token-scale", type=float, default=1.0,
                   help="multiply recorded token counts (fit a GPU run's lengths to the CPU model)")
    args = p.parse_args()
    schedules = tuple(x for x in args.schedules.split(",") if x)
    unknown = [x for x in schedules if x not in SCHEDULES]
    if unknown or "sync" not in schedules:
        p.error(f"--schedules: {', '.join(unknown) or 'sync missing'} (choose from "
                f"{', '.join(SCHEDULES)}; sync is the baseline every speedup is over)")
    if args.max_staleness < 1:
        p.error("--max-staleness must be >= 1")
    if args.max_tokens_per_pass < 0:
        p.error("--max-tokens-per-pass must be >= 0 (0: one source per pass)")
    recorded = None
    if args.release_trace:  # read first: a damaged trace fails before any set-up
        try:
            recorded = RecordedWorkload.from_run(args.release_trace,
                                                 token_scale=args.trace_token_scale)
        except (OSError, ValueError) as e:  # TraceError too: an unusable run directory
            p.exit(2, f"error: --release-trace: {e}\n")
    work = args.work or tempfile.mkdtemp(prefix="tsync-perf-")
    hf_dir = bench_model(os.path.join(work, "model"))
    ratios = [float(x) for x in args.ratios.split(",")] if args.ratios else \
        [1.0] if args.quick else [0.5, 1.0, 2.0]
    batches = [int(x) for x in args.batches.split(",")] if args.batches else \
        [64] if args.quick else [64, 128]
    if args.release_trace:
        with open(os.path.join(hf_dir, "config.json")) as f:
            positions = json.load(f)["max_position_embeddings"]
        if recorded.longest() > positions:
            p.error(f"--release-trace: the longest recorded trajectory has {recorded.longest()} "
                    f"tokens, the benchmark model {positions} positions; pass --trace-token-scale "
                    f"{positions / recorded.longest():.3g} or less")
        jobs = [dict(objective=recorded.objective, batch=recorded.batch, ratio=r, recorded=recorded)
                for r in ratios]
    else:
        jobs = [dict(objective=o, batch=b, ratio=r)
                for o in args.objectives.split(",") for b in batches for r in ratios]
    mbs = [int(x) for x in args.minibatches.split(",") if x]
    if any(m < 1 for m in mbs) or (max(mbs) > 1 and "opd" in {j["objective"] for j in jobs}):
        p.error("--minibatches: integers >= 1; more than 1 for GRPO only (--objectives grpo)")
    jobs = [dict(job, minibatches=m) for job in jobs for m in mbs]
    realtime = not args.no_realtime_io and realtime_io_permitted()
    if not args.no_realtime_io and not realtime:
        print("note: SCHED_FIFO not permitted here (CAP_SYS_NICE); the simulator and channel "
              "threads share the learners' cores at normal priority", flush=True)
    host = HostSetup(batch_sched=not args.normal_sched, realtime_io=realtime, pin=not args.no_pin)
    pack = args.max_tokens_per_pass
    print(f"baseline: sync packs direct-fold sources into passes of up to {pack} tokens "
          f"(learner.max_tokens_per_pass), as a verl/slime learner packs micro-batches; "
          f"every speedup is over that sync" if pack else
          "baseline: one source per forward/backward (--max-tokens-per-pass 0): sync is NOT "
          "packed here, so speedups are over a weaker baseline than a verl/slime user runs",
          flush=True)
    rows = []
    for job in jobs:
        new = cell(hf_dir, work, rounds=args.rounds, host=host, routing=args.routing,
                   schedules=schedules, max_staleness=args.max_staleness,
                   max_tokens_per_pass=pack, **job)
        _print(new)
        rows += new
    for c in mark_busy_host(rows):
        print(f"note: host busy during {c['objective']} r={c['ratio']} B={c['batch']} "
              f"{c['schedule']} (serving wall/CPU {c['wall_over_cpu']:.3f}, above the run's "
              f"other {c['schedule']} cells): re-run that cell before trusting it", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


def _print(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['objective']:4s} r={r['ratio']:<4} B={r['batch']:<3} m={r['minibatches']} "
              f"{r['schedule']:12s} step {r['step_time_s']:.3f}s  "
              f"speedup {r['speedup_measured']:.2f}x ±{r['speedup_stderr'] or 0:.2f} "
              f"(pred {r['speedup_predicted']:.2f}x, "
              f"{100 * r['measured_over_predicted']:.0f}%"
              + (f"; same service {r['speedup_same_service']:.2f}x"
                 if r.get("speedup_same_service") and r["schedule"] != "sync" else "")
              + f")  tail {r['learner_tail_s']:.3f}s"
              f"  r_eff {r['ratio_effective']:.2f}  wall/cpu {r['wall_over_cpu']:.3f}"
              + (f"  service/sync {r['service_vs_sync']:.3f} (arriving "
                 f"{r['service_vs_sync_arriving']:.3f})"
                 if r.get("service_vs_sync_arriving") is not None else "")
              + f"  packed {100 * r['packed_share']:.0f}%"
              + f"  policy lag {r['policy_lag_mean']:.2f}/{r['policy_lag_max']}"
              + f"  release lag {r['release_lag_ms']:.1f}/{r['release_lag_max_ms']:.0f}ms"
              + (f"  dispatch {100 * r['dispatch_overhead']:.2f}% (idle lane "
                 f"{100 * r['dispatch_idle']:.2f}%, n={r['dispatch_idle_n']})"
                 if r["dispatch_overhead"] is not None else ""), flush=True)


if __name__ == "__main__":
    try:
        main()
    except TraceError as e:  # a damaged trace of a benchmark run: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
