"""Core attention for the local layer spec through `torch.nn.functional.scaled_dot_product_attention`.

Megatron's local `DotProductAttention` materializes the [b, heads, sq, sk] score matrix, masks
and softmaxes it in separate kernels, a large share of a learner step's GPU time (profiles:
docs/measured/gpu.md). Without Transformer Engine this module is the fast path: SDPA picks a flash / memory-efficient kernel on GPU (a fused math path on CPU),
with grouped-query attention handled by the kernel instead of repeated K/V.

Same interface and tensor layout as `DotProductAttention` (it subclasses it, so K/V-span
forwards work unchanged): query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np·hn].
Masks: `None` with the layer's causal mask type means causal aligned to the last key (query i
of sq sees keys 0..sk−sq+i: a whole sequence when sq == sk, a span after sk−sq context
tokens), so no mask tensor is built and causal kernels skip the masked blocks. An explicit
megatron bool mask (True = masked) is honoured as given.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

__all__ = ["SDPAttention", "sdpa_sbhd"]


class SDPAttention(DotProductAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention supports softmax_type 'vanilla' only, got "
                             f"{self.config.softmax_type!r}")  # fmt: skip

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:  # fmt: skip
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        return sdpa_sbhd(query, key, value, self.softmax_scale, causal=causal,
                         mask=attention_mask)


def sdpa_sbhd(query: Tensor, key: Tensor, value: Tensor, scale: float | None, *, causal: bool,
              mask: Tensor | None = None) -> Tensor:
    """Megatron-layout attention through torch SDPA: query [sq, b, np, hn], key/value
    [sk, b, ng, hn] (ng divides np) -> [sq, b, np·hn].

    `mask`: a megatron bool mask (True = masked), honoured as given. Without one, `causal`
    aligns the diagonal to the last key (query i sees keys 0..sk−sq+i), so a span after
    sk−sq context tokens needs no mask tensor. Also the span forward's core attention for
    Transformer Engine layers (model/span.py), whose own kernel is called with sq == sk only.
    """
    sq, b, heads, hn = query.shape
    sk = key.shape[0]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
    kwargs = dict(scale=scale, enable_gqa=k.shape[1] != heads)
    if mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, **kwargs)
    elif causal and sq != sk:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), **kwargs)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and sq > 1, **kwargs)
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)
