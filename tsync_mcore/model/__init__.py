"""Megatron-Core model layer: parallel state (parallel), the HF ↔ Megatron bridge (bridge),
DDP and the optimizer (optimizer), K/V-span and packed forwards (span, packed, attention),
LoRA (lora, lora_spec), MoE routing replay (routing_replay), GGUF files as HF checkpoints
(gguf_import), and the tiny random HF checkpoints tests, benchmarks and the demo build
locally (tiny, tiny_moe).

Imports: util, platform, kernels."""
