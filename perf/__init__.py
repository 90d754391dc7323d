"""Benchmarks and studies of tsync-mcore, run as modules from the checkout's root
(`python -m perf.bench.run`, `python -m perf.studies.figure1`): `bench/` is the guarded
benchmark and its library, `studies/` the measurements run once or now and then."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
RESULTS = os.path.join(ROOT, "perf", "results")
