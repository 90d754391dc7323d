#!/usr/bin/env bash
# One command for a single H200/H100 (under 8 minutes, nothing downloaded): kernel benchmarks
# at real sizes (bandwidth as a fraction of HBM peak, fused log-prob vs torch), learner steps
# of a ~0.5B Qwen2-shaped model built locally with random weights (MFU, peak memory), and the
# learner sweep (Qwen2.5-1.5B/3B shapes, 2k/8k/32k-token sources, GRPO sync vs thundersync
# under the simulated rollout at r = 1, fused LM head on and off: perf/bench/gpu_sweep.py).
# Writes perf/results/<date>-<host>-gpu.json. Without a CUDA GPU it says so and exits 0.
#   perf/gpu.sh [gpu_step.py flags, e.g. --skip-kernels --sweep-models 1.5b]
# megatron-core: when the interpreter lacks it and perf/wheels/ holds the megatron-core wheel
# for its Python (pure Python but for a dataset helper the learner never imports; see
# perf/README.md "GPU"), it is installed from there into a scratch directory, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

megatron_from_wheel() {  # $1: python; prints a site directory to prepend, or nothing
    local py=$1 whl tag site
    "$py" -c 'import megatron.core' 2>/dev/null && return 0
    tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    whl=$(ls perf/wheels/megatron_core-*-"$tag"-*.whl 2>/dev/null | head -n 1 || true)
    if [[ -z "$whl" ]]; then
        echo "gpu.sh: megatron-core not importable and no $tag wheel in perf/wheels/: the learner step runs the hf proxy, no sweep" >&2
        return 0
    fi
    if ! "$py" -c 'import numpy, packaging' 2>/dev/null; then  # its import-time dependencies
        echo "gpu.sh: numpy/packaging missing for $py: not installing $whl" >&2
        return 0
    fi
    site=$(mktemp -d "${TMPDIR:-/tmp}/tsync-mcore-site.XXXXXX")
    if PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$py" -m pip install --quiet --no-deps --no-index --target "$site" "$whl" >&2; then
        echo "gpu.sh: megatron-core from $whl" >&2
        echo "$site"
    else
        echo "gpu.sh: installing $whl failed: the learner step runs the hf proxy, no sweep" >&2
    fi
}

# The first interpreter whose torch sees a GPU: $PYTHON, then python3, then the repo's .venv
# (`make setup` installs CPU torch there, so on a GPU box it is normally not the one).
tried=()
for py in ${PYTHON:-} python3 .venv/bin/python; do
    command -v "$py" >/dev/null 2>&1 || continue
    tried+=("$py")
    if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        site=$(megatron_from_wheel "$py") || site=""
        if [[ -n "$site" ]]; then export PYTHONPATH="$site:${PYTHONPATH:-}"; fi
        exec timeout 470 "$py" -m perf.bench.gpu_step "$@"
    fi
done
echo "gpu.sh: no CUDA GPU: torch.cuda.is_available() is False for ${tried[*]:-no python found}; nothing to run"
exit 0
