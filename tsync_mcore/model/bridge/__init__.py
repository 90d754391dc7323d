"""Hugging Face Qwen2 / Qwen3 / Qwen3-MoE / Llama checkpoints <-> Megatron-Core GPTModel, a
small converter of our own (mbridge needs TE and CUDA), in four parts:

spec      what a checkpoint is (ModelSpec from config.json)
weights   HF names <-> Megatron parameters, TP shard math, loading and export
build     the GPTModel for a spec: layer specs, TransformerConfig, MoE, CPU adjustments
forward   logits and the final hidden states of a built model

Import what you need from here (`bridge.build_model`, `bridge.logits`, …)."""

from tsync_mcore.model.bridge.build import (ATTENTIONS, attention_mode, build_model,
                                            unwrap)
from tsync_mcore.model.bridge.forward import (HeadInput, causal_mask, final_hidden,
                                              head_input, logits)
from tsync_mcore.model.bridge.spec import ModelSpec, load_hf_config
from tsync_mcore.model.bridge.weights import (export_hf, export_hf_state_dict, hf_param_names,
                                              is_expert_param, iter_hf, load_hf_state_dict)

__all__ = ["ATTENTIONS", "HeadInput", "ModelSpec", "attention_mode", "build_model",
           "causal_mask", "export_hf", "export_hf_state_dict", "final_hidden", "head_input",
           "hf_param_names", "is_expert_param", "iter_hf", "load_hf_config",
           "load_hf_state_dict", "logits", "unwrap"]
