"""Entry points: the launchers (run, learner, rollout, demo) and their shared plumbing
(launch: config from arguments, one-line errors, process supervision). Each module has a
`main()` that `[project.scripts]` and the thin `launch/*.py` wrappers call.

Imports: anything; nothing imports cli."""
