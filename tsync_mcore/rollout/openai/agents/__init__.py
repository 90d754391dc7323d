"""Agents that run as separate processes against the rollout's OpenAI-compatible endpoint
(docs/guide/agents.md); `digits` is the demo's."""
