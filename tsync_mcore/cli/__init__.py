"""Entry points: the launchers (run, learner, rollout, demo), `make real-model`
(real_model) and their shared plumbing (launch: config from arguments, one-line errors,
process supervision). Each module has a `main()` that `[project.scripts]`, the thin
`launch/*.py` wrappers or the Makefile call.

Imports: anything; nothing imports cli."""
