#!/usr/bin/env bash
# One command for a single H200/H100 (under 8 minutes, nothing downloaded): kernel benchmarks
# at real sizes (bandwidth as a fraction of HBM peak, fused log-prob vs torch) and learner
# steps of a ~0.5B Qwen2-shaped model built locally with random weights (MFU, peak memory).
# Writes perf/results/<date>-<host>-gpu.json. Without a CUDA GPU it says so and exits 0.
#   perf/gpu.sh [gpu_step.py flags, e.g. --backend hf --sources 8]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# The first interpreter whose torch sees a GPU: $PYTHON, then python3, then the repo's .venv
# (`make setup` installs CPU torch there, so on a GPU box it is normally not the one).
tried=()
for py in ${PYTHON:-} python3 .venv/bin/python; do
    command -v "$py" >/dev/null 2>&1 || continue
    tried+=("$py")
    if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        exec timeout 470 "$py" perf/gpu_step.py "$@"
    fi
done
echo "gpu.sh: no CUDA GPU: torch.cuda.is_available() is False for ${tried[*]:-no python found}; nothing to run"
exit 0
