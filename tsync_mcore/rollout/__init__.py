"""Rollout side: vLLM generation with in-place weight reload (engine, replicas), environments
(envs, dataset_env, terminal_env), the built-in agent loop (loop; types: what it shares with
openai/), the data feed and pacing, the driver that runs a schedule against the channel
(driver: setup; schedules: the loops, functions over batch.BatchRunner, which runs one batch
from plan, through agents, sources and learners; served: the version the engines serve;
evaluation), and the OpenAI endpoint (openai/). The receiving side of publication is
tsync_mcore.publication.receive.

Imports: anything below learner (util … publication); never learner or cli.

Import the submodules directly; `engine` imports vLLM lazily (only when an engine is built).
"""
