"""Running model-written code: the process jail (jail: run/start in new namespaces as a
throw-away uid, rlimits, no network, a wall-clock budget, everything killed after; launcher:
what runs inside before the program; seccomp, cgroups, view: its system-call filter, per-call
cgroups and filesystem view) and the agent tools built on it (tools: `python`, `bash`, their
OpenAI schemas and call parsing).

Imports: util only."""
