"""Shared test helpers: independent references (reference, lora_reference, moe_reference),
batch and record builders, the torchrun launcher (dist_util), network namespaces (netns),
paths, and the worker scripts that integration tests start (workers/)."""
