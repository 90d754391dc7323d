"""Measurements run once or now and then, each a module with its command in its docstring;
their figures are in docs/measured/ (perf/README.md lists which)."""
