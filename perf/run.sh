#!/usr/bin/env bash
# One command, one result file: `perf/run.sh [--quick]`.
# Runs everything that fits this machine (quick: under 10 minutes), writes
# perf/results/<date>-<host>.json (+ plots), prints a table, and compares with the
# committed baseline (perf/baseline.json) when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
QUICK=""
[ "${1:-}" = "--quick" ] && QUICK="--quick"
stamp="$(date +%Y%m%d)-$(hostname)"
# A later run the same day keeps the earlier result: it gets the time of day as well.
[ -e "perf/results/${stamp}.json" ] && stamp="${stamp}-$(date +%H%M)"
out="perf/results/${stamp}.json"
work="$(mktemp -d /tmp/tsync-perf-XXXX)"
mkdir -p perf/results
echo "== overlap (rollout simulator → channel → 2 learner ranks) =="
# SCHEDULES=sync,group_ready,thundersync perf/run.sh: the synchronous three only (faster)
$PY -m perf.bench.run $QUICK ${SCHEDULES:+--schedules "$SCHEDULES"} --out "$work/overlap.json" \
    --work "$work"
echo "== kernels =="
$PY -m perf.bench.kernels $QUICK --json "$work/kernels.json"
$PY -m perf.bench.collect --overlap "$work/overlap.json" --kernels "$work/kernels.json" --out "$out" \
    --plots "perf/results/${stamp}"
if [ -f perf/baseline.json ]; then
  $PY -m perf.bench.check "$out" --baseline perf/baseline.json
fi
echo "result: $out"
