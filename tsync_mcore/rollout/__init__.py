"""Rollout side: vLLM generation with in-place weight reload (engine, replicas), environments
(envs, dataset_env, terminal_env), the built-in agent loop (loop), the data feed and pacing,
the driver that runs schedules against the channel (driver: setup and dispatch; schedules:
the loops; batch: one batch; evaluation), and the OpenAI endpoint (openai/). The receiving
side of publication is tsync_mcore.publication.receive.

Imports: anything below learner (util … publication); never learner or cli.

Import the submodules directly; `engine` imports vLLM lazily (only when an engine is built).
"""
