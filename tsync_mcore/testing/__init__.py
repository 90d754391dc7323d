"""Test helpers: tiny random HF checkpoints (tiny)."""
