"""The guarded benchmark (`perf/run.sh`: the overlap benchmark and the kernels, checked
against perf/baseline.json; `perf/gpu.sh` against perf/baseline-gpu.json) and its library:
the benchmark model, the simulated rollout's workloads and schedules, the cell runner, the
trace analysis, and the run-per-schedule driver the studies share."""
