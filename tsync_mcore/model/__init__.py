"""Megatron-Core model layer: parallel state (parallel), HF bridge (bridge), DDP/optimizer (train)."""
