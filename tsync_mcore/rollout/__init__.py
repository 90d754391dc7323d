"""Rollout side: vLLM generation with in-place weight reload, environments, the agent loop.

Import the submodules directly; `engine` imports vLLM lazily (only when an engine is built).
"""
