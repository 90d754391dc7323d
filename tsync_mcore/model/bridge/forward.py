"""Forwards of a built model: causal masks, logits, and the final hidden states the fused
LM head consumes (HeadInput)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tsync_mcore import platform
from tsync_mcore.model.bridge.build import attention_mode, unwrap

# --------------------------------------------------------------------------- forward


def causal_mask(seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Megatron's attention mask: bool [1, 1, S, S], True = masked (future positions)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def _forward_inputs(model: torch.nn.Module, tokens: torch.Tensor) -> dict:
    b, s = tokens.shape
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    # SDPAttention takes None as causal (no mask tensor, causal kernels)
    mask = None if platform.on_gpu() or attention_mode(model) == "causal" else causal_mask(s, tokens.device)
    return dict(input_ids=tokens, position_ids=position_ids, attention_mask=mask)


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Forward `tokens` [B, S] -> logits [B, S, V/tp] (this rank's vocab shard).

    GPTModel (mcore 0.16.1) runs sequence-first internally and transposes the output to
    batch-first when no labels are given. Positions are 0..S-1 per row; the causal mask is
    passed explicitly on CPU (megatron's default one is built on CUDA).
    """
    b, s = tokens.shape
    out = model(**_forward_inputs(model, tokens))
    assert out.shape[:2] == (b, s), f"unexpected logits shape {tuple(out.shape)}"
    return out


@dataclass(frozen=True)
class HeadInput:
    """What the output layer would read, for the fused LM head (kernels/lm_head.py).

    logits = hidden @ weight^T, this rank's vocab shard. `hidden` has passed Megatron's
    copy-to-TP region (identity forward, all-reduce of its gradient over TP), as
    ColumnParallelLinear's input does, so a shard-local backward through it is whole."""

    hidden: torch.Tensor  # [..., H] final-normed hidden states
    weight: torch.Tensor  # [V_local, H]: output_layer.weight, or the tied word embedding


def head_input(model: torch.nn.Module, hidden: torch.Tensor) -> HeadInput:
    """The output layer's input and weight for final-normed `hidden` (any leading shape)."""
    gpt = unwrap(model)
    layer = gpt.output_layer
    if layer.sequence_parallel or layer.bias is not None:
        raise ValueError("the fused LM head supports an output layer without sequence "
                         "parallelism or bias")
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else layer.weight
    if layer.tp_group.size() > 1:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
        hidden = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
    return HeadInput(hidden, weight)


def final_hidden(model: torch.nn.Module, tokens: torch.Tensor) -> HeadInput:
    """`logits` without the output layer: the final-normed hidden states [B, S, H] and the
    output weight, so a fused head computes what it needs from them (kernels/lm_head.py)."""
    b, s = tokens.shape
    gpt = unwrap(model)
    # why: GPTModel._postprocess returns the decoder's (final-normed) output when
    # post_process is off; the rest of the forward is the model's own, unchanged.
    gpt.post_process = False
    try:
        out = model(**_forward_inputs(model, tokens))  # [S, B, H]
    finally:
        gpt.post_process = True
    assert out.shape[:2] == (s, b), f"unexpected hidden shape {tuple(out.shape)}"
    return head_input(gpt, out.transpose(0, 1))
