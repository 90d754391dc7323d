"""Regression guard: compare a perf result file against the committed baseline, by ratios only.

    python -m perf.bench.check RESULT.json [--baseline perf/baseline.json] [--tolerance 0.15]
                         [--strict] [--write-baseline [--noise-from RUN.json ...]]

Result schema: {"machine", "date", "overlap": [cells], "kernels": [records]}.
- overlap cells, keyed by (objective, schedule, ratio, batch): `speedup_measured` and
  `speedup_measured / speedup_predicted` may not drop by more than the tolerance (relative).
- kernel records (perf/bench/kernels.py), keyed by (name, impl, shape): `time/plain` (time over the
  `plain` record of the same name and shape; the fastest rep `time_min_s` where both records
  have it, as load on a shared machine only ever adds time, else the median `time_s`) may not
  rise by more than the tolerance, and
  `bw_fraction` (bytes/s over the file's best `stream_bandwidth` record) may not drop by more.
- the GPU learner step (perf/bench/gpu_step.py), keyed by backend, shape and attention mode:
  `mfu_active` may not drop by more than the tolerance (guard GPU runs with
  `--baseline perf/baseline-gpu.json`).
- the GPU learner sweep (perf/bench/gpu_sweep.py, list `sweep`), keyed by model, shape, fused LM
  head and attention mode: the trainer's active `mfu_active` and thundersync's
  `speedup_vs_sync` may not drop by more than the tolerance; a cell that did not run ("oom",
  skipped for time) has no metrics, so a baseline cell it replaces is missing.
Absolute times are never compared, so a baseline from one machine guards another of its kind.
A baseline may hold `noise`: "cell | metric" → the relative range that metric spanned over
repeated runs of unchanged code; such a cell's tolerance is the larger of the two (the big
CPU log-prob shapes, whose time is page faults of a 0.6–1 GB [T, V] tensor, moved by up to
+78 % run to run here). `--write-baseline --noise-from R1.json R2.json ...` measures it for
the kernel records over those runs and RESULT (give only runs of the same kernel code).
Cells in the baseline but not the result are reported as missing: a failure only with
--strict. Exit 1 with a table naming each regression, 2 for unusable input, 0 otherwise.
--write-baseline copies RESULT to the baseline path instead of comparing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

__all__ = ["InputError", "compare", "kernel_metrics", "kernel_noise", "main", "overlap_metrics",
           "step_metrics", "sweep_metrics"]

DEFAULT_BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baseline.json")
HIGHER, LOWER = "higher", "lower"  # which direction is better


def _fmt_shape(shape) -> str:
    if isinstance(shape, dict):
        return ",".join(f"{k}={shape[k]}" for k in sorted(shape))
    return "" if shape is None else str(shape)


def _overlap_cell(c: dict) -> str:
    return (f"overlap {c.get('objective')}/{c.get('schedule')} "
            f"ratio={c.get('ratio')} batch={c.get('batch')}")


def overlap_metrics(cells: list[dict]) -> dict[tuple[str, str], tuple[float, str]]:
    """(cell, metric) -> (value, better direction) for the overlap cells."""
    out = {}
    for c in cells:
        cell = _overlap_cell(c)
        measured, predicted = c.get("speedup_measured"), c.get("speedup_predicted")
        if measured is not None:
            out[cell, "speedup_measured"] = (float(measured), HIGHER)
            if predicted:
                out[cell, "measured/predicted"] = (float(measured) / float(predicted), HIGHER)
    return out


def kernel_metrics(records: list[dict]) -> dict[tuple[str, str], tuple[float, str]]:
    """(cell, metric) -> (value, better direction) for the kernel records that were timed."""
    timed = [r for r in records if r.get("time_s")]
    plain = {(r["name"], _fmt_shape(r.get("shape"))): r for r in timed if r.get("impl") == "plain"}
    stream = [r["bytes_per_s"] for r in timed if r["name"] == "stream_bandwidth" and r.get("bytes_per_s")]
    bandwidth = max(stream, default=None)
    out = {}
    for r in timed:
        if r.get("impl") == "plain" or r["name"] == "stream_bandwidth":
            continue
        shape = _fmt_shape(r.get("shape"))
        cell = f"kernel {r['name']}[{r.get('impl')}] {shape}".rstrip()
        ref = plain.get((r["name"], shape))
        if ref:
            key = "time_min_s" if r.get("time_min_s") and ref.get("time_min_s") else "time_s"
            out[cell, "time/plain"] = (r[key] / ref[key], LOWER)
        if bandwidth and r.get("bytes_per_s"):
            out[cell, "bw_fraction"] = (r["bytes_per_s"] / bandwidth, HIGHER)
    return out


def step_metrics(step: dict | None) -> dict[tuple[str, str], tuple[float, str]]:
    """The GPU learner step (perf/bench/gpu_step.py): MFU, a fraction of the device's peak."""
    if not step or step.get("error") or not step.get("mfu_active"):
        return {}
    cell = (f"learner step {step.get('backend')} {step.get('n_sources')}x{step.get('seq_len')} "
            f"attention={step.get('attention')}")
    return {(cell, "mfu_active"): (float(step["mfu_active"]), HIGHER)}


def sweep_metrics(cells: list[dict]) -> dict[tuple[str, str], tuple[float, str]]:
    """The GPU learner sweep (perf/bench/gpu_sweep.py): per cell that ran, the trainer's active MFU
    and thundersync's speedup over sync."""
    out = {}
    for c in cells:
        if c.get("status") != "ok":
            continue
        head = {True: "on", False: "off"}.get(c.get("fused_lm_head"), "n/a")
        cell = (f"sweep {c.get('model')} {c.get('n_sources')}x{c.get('seq_len')} "
                f"fused_head={head} attention={c.get('attention')}")
        if c.get("mfu_active"):
            out[cell, "mfu_active"] = (float(c["mfu_active"]), HIGHER)
        if c.get("speedup_vs_sync"):
            out[cell, f"speedup_vs_sync r={c.get('ratio')}"] = (float(c["speedup_vs_sync"]), HIGHER)
    return out


def _metrics(doc: dict) -> dict[tuple[str, str], tuple[float, str]]:
    return {**overlap_metrics(doc.get("overlap") or []), **kernel_metrics(doc.get("kernels") or []),
            **step_metrics(doc.get("step")), **sweep_metrics(doc.get("sweep") or [])}


def _noise_key(cell: str, metric: str) -> str:
    return f"{cell} | {metric}"


def kernel_noise(docs: list[dict]) -> dict[str, float]:
    """"cell | metric" → relative range of each kernel metric over `docs` (runs of the same
    code): max/min − 1, the change a regression check would see between two of them."""
    values: dict[tuple[str, str], list[float]] = {}
    for doc in docs:
        for key, (value, _) in kernel_metrics(doc.get("kernels") or []).items():
            values.setdefault(key, []).append(value)
    return {_noise_key(*key): round(max(vs) / min(vs) - 1, 4)
            for key, vs in values.items() if len(vs) == len(docs) and min(vs) > 0}


def compare(result: dict, baseline: dict, tolerance: float = 0.15) -> list[dict]:
    """One row per baseline metric (and per new one): status ok | regression | missing | new.
    A cell's tolerance is the larger of `tolerance` and its measured noise in the baseline."""
    new, old = _metrics(result), _metrics(baseline)
    noise = baseline.get("noise") or {}
    rows = []
    for key, (base, better) in old.items():
        cell, metric = key
        tol = max(tolerance, float(noise.get(_noise_key(cell, metric), 0.0)))
        row = {"cell": cell, "metric": metric, "baseline": base, "result": None, "change": None,
               "tolerance": tol}
        if key not in new:
            rows.append({**row, "status": "missing"})
            continue
        value = new[key][0]
        change = value / base - 1 if base else 0.0
        worse = change < -tol if better == HIGHER else change > tol
        rows.append({**row, "result": value, "change": change, "status": "regression" if worse else "ok"})
    for (cell, metric), (value, _) in new.items():
        if (cell, metric) not in old:
            rows.append({"cell": cell, "metric": metric, "baseline": None, "result": value,
                         "change": None, "tolerance": None, "status": "new"})  # fmt: skip
    return rows


def format_rows(rows: list[dict]) -> str:
    def num(x, pct=False):
        return "-" if x is None else (f"{x:+.1%}" if pct else f"{x:.4g}")

    table = [("status", "cell", "metric", "baseline", "result", "change", "tolerance")]
    table += [(r["status"].upper() if r["status"] != "ok" else "ok", r["cell"], r["metric"],
               num(r["baseline"]), num(r["result"]), num(r["change"], pct=True),
               "-" if r.get("tolerance") is None else f"{r['tolerance']:.0%}") for r in rows]  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


class InputError(ValueError):
    """A result or baseline file that cannot be compared."""


def _load(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        hint = " (create it with --write-baseline)" if what == "baseline" else ""
        raise InputError(f"check: {what} {path} does not exist{hint}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"check: {what} {path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("overlap", []), list) \
            or not isinstance(doc.get("kernels", []), list) \
            or not isinstance(doc.get("sweep", []), list):  # fmt: skip
        raise InputError(f"check: {what} {path} needs an object with lists 'overlap' and "
                         f"'kernels' (and 'sweep', when present)")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE)
    ap.add_argument("--tolerance", type=float, default=0.15, help="relative, e.g. 0.15 = 15%%")
    ap.add_argument("--strict", action="store_true", help="missing cells fail too")
    ap.add_argument("--write-baseline", action="store_true", help="copy RESULT to --baseline")
    ap.add_argument("--noise-from", nargs="+", default=None, metavar="RUN.json",
                    help="with --write-baseline: earlier runs of the same kernel code; each "
                         "kernel metric's range over them and RESULT goes into the baseline")
    args = ap.parse_args(argv)
    if args.noise_from and not args.write_baseline:
        ap.error("--noise-from goes with --write-baseline")
    try:
        result = _load(args.result, "result")
        if args.write_baseline:
            os.makedirs(os.path.dirname(os.path.abspath(args.baseline)), exist_ok=True)
            if args.noise_from:
                runs = [_load(p, "run") for p in args.noise_from]
                doc = {**result, "noise": kernel_noise(runs + [result]),
                       "noise_from": [os.path.basename(p) for p in args.noise_from]
                       + [os.path.basename(args.result)]}
                with open(args.baseline, "w") as f:
                    json.dump(doc, f, indent=1)
                    f.write("\n")
            else:
                shutil.copyfile(args.result, args.baseline)
            print(f"check: wrote baseline {args.baseline} from {args.result}")
            return 0
        baseline = _load(args.baseline, "baseline")
    except InputError as exc:
        print(exc, file=sys.stderr)
        return 2
    if result.get("machine") != baseline.get("machine"):
        print(f"note: machine differs: baseline {baseline.get('machine')!r}, "
              f"result {result.get('machine')!r}")
    hosts = [sorted({json.dumps(c.get("host"), sort_keys=True) for c in d.get("overlap", [])})
             for d in (baseline, result)]
    if hosts[0] != hosts[1]:
        print(f"note: overlap host set-up differs (scheduling, real-time I/O, pinning): "
              f"baseline {', '.join(hosts[0])}; result {', '.join(hosts[1])}")
    rows = compare(result, baseline, args.tolerance)
    failing = {"regression"} | ({"missing"} if args.strict else set())
    bad = [r for r in rows if r["status"] in failing]
    print(format_rows(rows))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "regression", "missing", "new")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()) + f" (tolerance {args.tolerance:.0%})")
    if bad:
        also = " or missing (--strict)" if args.strict else ""
        print(f"\nFAIL: {len(bad)} cell(s) beyond tolerance{also}:")
        print(format_rows(bad))
        # the benchmark flags cells run while something else held the learners' cores
        busy = {_overlap_cell(c) for c in result.get("overlap", []) if c.get("host_busy")}
        for cell in sorted({r["cell"] for r in bad} & busy):
            print(f"note: {cell}: the host was busy during this cell (serving wall/CPU above "
                  f"the run's other cells of its schedule): re-run it before trusting this")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
