"""Agents that run as separate processes against the rollout's OpenAI-compatible endpoint
(docs/agents.md); `digits` is the demo's."""
