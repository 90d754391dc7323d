"""K/V-span forward: run a span of tokens of one sequence against earlier keys/values.

Built from the GPTModel's own submodules (embedding, RoPE, per-layer norms, QKV, core
attention, projections, MLP, final norm, output layer): no second model implementation.
`GPTModel.forward` always applies RoPE from position 0 and runs self-attention only, so the
span version calls the submodules in the same order itself:

    x = embedding(tokens)
    per layer:  h = input_layernorm(x); q, k, v = get_query_key_value_tensors(h)  (q/k-norm)
                q, k = RoPE at positions offset..offset+n-1
                K, V = cat(past K/V, k, v); ctx = core_attention(q, K, V, mask [1,1,n,P+n])
                x = self_attn_bda(linear_proj(ctx), x); x = mlp_bda(mlp(pre_mlp_layernorm(x)), x)
    logits = output_layer(final_layernorm(x))        (vocab-parallel at TP > 1)
             (fused_head: final_layernorm(x) and the output weight instead, for kernels/lm_head.py)

K/V are kept per layer after RoPE and k-norm, in query-group form `[n, 1, ng_local, hn]`.
Passing `past` as detached leaves makes backward deliver both the span's parameter gradient
and the adjoints of the context K/V (per-turn distillation, shared GRPO prefixes).

Layer specs: the local one (megatron's `DotProductAttention` with an explicit span mask, or
`attention.SDPAttention`) and Transformer Engine's. Under TE the input norm is fused into
`linear_qkv` (and the pre-MLP norm into `linear_fc1`), the separate norms are identities, so
the loop above is the same; TE's core attention is used for a span without context (sq ==
sk) and a span after context goes through torch SDPA (flash on GPU) with the causal diagonal
aligned to the last key (`attention.sdpa_sbhd`), with TE's softmax scale.
Requirements (checked): no fused masked softmax on the local spec (the fused causal kernel
ignores the span mask; `bridge` builds with `masked_softmax_fusion=False`), vanilla softmax
and no fp8 under TE, dropout 0 (recompute must be bit-identical), no sequence/context
parallelism, plain RoPE.

At TP > 1 the embedding, QKV (when groups < TP), projections and output layer hold
collectives: every TP rank must make the same sequence of span_forward calls (same n,
offset, stop_after_kv / want_logits).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from tsync_mcore.model.attention import SDPAttention, sdpa_sbhd
from tsync_mcore.model.bridge import HeadInput, head_input, unwrap

__all__ = ["KV", "span_forward", "concat_kv", "detached_leaves", "kv_bytes", "span_mask",
           "leaf_adjoints", "backward_kv", "check_supported", "span_attention"]


@dataclass
class KV:
    """One layer's keys and values for a token range, after RoPE (and k-norm)."""

    k: Tensor  # [n, 1, ng_local, hn]
    v: Tensor  # [n, 1, ng_local, hn]

    def __len__(self) -> int:
        return self.k.shape[0]


def concat_kv(parts: list[list[KV]]) -> list[KV]:
    """Per layer, concatenate the spans' K/V along tokens (in the order given)."""
    if not parts:
        raise ValueError("concat_kv needs at least one span")
    if len({len(p) for p in parts}) != 1:
        raise ValueError(f"spans have different layer counts: {[len(p) for p in parts]}")
    if len(parts) == 1:
        return list(parts[0])
    return [
        KV(torch.cat([p[i].k for p in parts]), torch.cat([p[i].v for p in parts]))
        for i in range(len(parts[0]))
    ]


def detached_leaves(kv: list[KV], requires_grad: bool = True) -> list[KV]:
    """`kv` detached (and contiguous; no copy when it already is), as autograd leaves.

    Their `.grad` accumulates the adjoint from every later span that attends to them.
    """
    # why: contiguous because DotProductAttention `.view`s keys/values (and cat is cheaper).
    return [
        KV(
            x.k.detach().contiguous().requires_grad_(requires_grad),
            x.v.detach().contiguous().requires_grad_(requires_grad),
        )
        for x in kv
    ]


def kv_bytes(kv: list[KV]) -> int:
    """Bytes held by the K/V tensors (this rank's query groups)."""
    return sum(t.numel() * t.element_size() for x in kv for t in (x.k, x.v))


def leaf_adjoints(leaves: list[KV]) -> list[tuple[Tensor | None, Tensor | None]]:
    """The gradients accumulated on K/V leaves so far (None where nothing flowed back)."""
    return [(x.k.grad, x.v.grad) for x in leaves]


def backward_kv(produced: list[KV], adjoint: list[tuple[Tensor | None, Tensor | None]]) -> bool:
    """Backpropagate adjoints of graph-attached K/V; False when there is nothing to push."""
    outs, grads = [], []
    for kv, (gk, gv) in zip(produced, adjoint):
        for t, g in ((kv.k, gk), (kv.v, gv)):
            if g is not None:
                outs.append(t)
                grads.append(g.to(t.dtype))
    if outs:
        torch.autograd.backward(outs, grads)
    return bool(outs)


def span_mask(n: int, past_len: int, device: torch.device | None = None) -> Tensor:
    """Megatron bool mask [1, 1, n, P+n], True = masked: query i sees keys 0..P+i."""
    full = torch.ones(n, past_len + n, dtype=torch.bool, device=device)
    return torch.triu(full, diagonal=past_len + 1)[None, None]


def check_supported(model: GPTModel) -> None:
    """Raise ValueError when `model` cannot run span (or packed) forwards, saying why."""
    cfg = model.config
    if model.position_embedding_type != "rope" or not (model.pre_process and model.post_process):
        raise ValueError("span_forward needs a RoPE GPTModel holding embedding and output layer")
    if cfg.sequence_parallel or cfg.context_parallel_size > 1 or cfg.window_size is not None:
        raise ValueError("span_forward supports neither sequence/context parallel nor windows")
    if cfg.attention_dropout or cfg.hidden_dropout:
        raise ValueError(
            "span_forward needs attention_dropout = hidden_dropout = 0: the replay recompute "
            f"must reproduce the forward (got {cfg.attention_dropout}, {cfg.hidden_dropout})"
        )
    sa = model.decoder.layers[0].self_attention
    if sa.attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"span_forward needs causal self-attention, got {sa.attn_mask_type}")
    core = sa.core_attention
    if _is_te_attention(core):
        if cfg.softmax_type != "vanilla" or cfg.fp8:
            raise ValueError(
                "span_forward with Transformer Engine layers supports vanilla softmax without "
                f"fp8 (got softmax_type {cfg.softmax_type!r}, fp8 {cfg.fp8!r})"
            )
    elif not isinstance(core, DotProductAttention):
        raise ValueError(
            f"span_forward needs megatron's DotProductAttention, SDPAttention or Transformer "
            f"Engine's DotProductAttention as core attention, got {type(core).__name__}"
        )
    elif core.scale_mask_softmax.scaled_masked_softmax_fusion:
        raise ValueError(
            "span_forward needs masked_softmax_fusion=False: the fused causal softmax ignores "
            "the span mask (and asserts sq == sk)"
        )


def _is_te_attention(core: torch.nn.Module) -> bool:
    # why: a TE model means transformer_engine is imported; never import it here (no CUDA)
    te = sys.modules.get("transformer_engine.pytorch")
    return te is not None and isinstance(core, te.DotProductAttention)


def span_attention(core: torch.nn.Module, q: Tensor, k: Tensor, v: Tensor, offset: int) -> Tensor:
    """Causal core attention of a span's queries q [n, 1, np, hn] (positions offset..offset+n-1)
    over keys/values k, v [offset+n, 1, ng, hn] -> [n, 1, np·hn]."""
    causal = AttnMaskType.causal
    if isinstance(core, SDPAttention):  # None = causal aligned to the last key
        return core(q, k, v, None, attn_mask_type=causal)
    if isinstance(core, DotProductAttention):  # honours an explicit mask with sq != sk
        return core(q, k, v, span_mask(q.shape[0], offset, q.device), attn_mask_type=causal)
    if offset == 0:  # TE: its own kernels for sq == sk, as in the full forward
        return core(q, k, v, None, attn_mask_type=causal)
    # TE's "causal" aligns the diagonal top-left (wrong for sq < sk): SDPA, bottom-right
    return sdpa_sbhd(q, k, v, softmax_scale(core, q.shape[-1]), causal=True)


def softmax_scale(core: torch.nn.Module, head_dim: int) -> float:
    """The scale `core` applies to q·k: its own attribute on the local cores; for TE's, what
    megatron passes it (config.softmax_scale) or TE's default 1/sqrt(kv_channels)."""
    if isinstance(core, DotProductAttention):
        return core.softmax_scale
    return core.config.softmax_scale or 1.0 / math.sqrt(head_dim)


def span_forward(
    model: torch.nn.Module,
    tokens: Tensor,
    offset: int,
    past: list[KV] | None,
    *,
    want_logits: bool = True,
    stop_after_kv: bool = False,
    fused_head: bool = False,
) -> tuple[Tensor | HeadInput | None, list[KV]]:
    """Run `tokens` [n] at positions offset..offset+n-1 against `past` and causally on itself.

    `past`: per layer, K/V of positions 0..offset-1 (None when offset == 0), typically
    `detached_leaves(concat_kv(earlier spans))`. Returns (logits [n, V_local] in the model
    dtype, or None; this span's K/V per layer, attached to the graph). With
    `stop_after_kv=True` (replay recompute) or `want_logits=False` it returns right after the
    last layer's K/V: the last layer's attention/MLP, the final norm and the output layer
    feed only the logits. With `fused_head=True` it returns, instead of the logits, the
    final-normed hidden states [n, H] and the output weight (`bridge.HeadInput`) for the
    fused LM head (kernels/lm_head.py), which never materializes them.
    """
    gpt = unwrap(model)
    check_supported(gpt)
    layers = gpt.decoder.layers
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise ValueError(f"tokens must be a non-empty 1-D tensor, got {tuple(tokens.shape)}")
    if past is None:
        if offset != 0:
            raise ValueError(f"past is None but offset is {offset}")
    elif len(past) != len(layers) or any(len(x) != offset or len(x.v) != offset for x in past):
        raise ValueError(
            f"past must hold {len(layers)} layers of {offset} tokens, got "
            f"{[(len(x), len(x.v)) for x in past]}"
        )
    n = tokens.numel()
    stop = stop_after_kv or not want_logits
    cfg = gpt.config

    x = gpt.embedding(input_ids=tokens[None], position_ids=None)  # [n, 1, h]
    # why: equals rotary_pos_emb(offset + n)[offset:] (positions are arange(n) + offset).
    freqs = gpt.rotary_pos_emb(n, offset=offset)
    out_kv: list[KV] = []
    for i, layer in enumerate(layers):
        sa = layer.self_attention
        residual = x
        # TE spec: input_layernorm is an identity, the norm runs fused inside linear_qkv
        q, k, v = sa.get_query_key_value_tensors(layer.input_layernorm(x))
        rope = dict(config=cfg, cp_group=sa.pg_collection.cp)
        # why: contiguous, since callers keep and concatenate them (v is a split view)
        k = rope_utils.apply_rotary_pos_emb(k, freqs, **rope).contiguous()
        v = v.contiguous()
        out_kv.append(KV(k, v))
        if stop and i == len(layers) - 1:
            return None, out_kv
        q = rope_utils.apply_rotary_pos_emb(q, freqs, **rope)
        keys = k if past is None else torch.cat([past[i].k, k])
        values = v if past is None else torch.cat([past[i].v, v])
        ctx = span_attention(sa.core_attention, q, keys, values, offset)
        attn = sa.linear_proj(ctx)
        x = layer.self_attn_bda(layer.training, cfg.bias_dropout_fusion)(
            attn, residual, layer.hidden_dropout
        )
        mlp = layer.mlp(layer.pre_mlp_layernorm(x))
        x = layer.mlp_bda(layer.training, cfg.bias_dropout_fusion)(mlp, x, layer.hidden_dropout)

    x = gpt.decoder.final_layernorm(x)
    if fused_head:
        return head_input(gpt, x[:, 0]), out_kv
    weight = None
    if gpt.share_embeddings_and_output_weights:
        weight = gpt.shared_embedding_or_output_weight()
    logits, _ = gpt.output_layer(x, weight=weight)
    return logits[:, 0], out_kv
