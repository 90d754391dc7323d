"""Packed K/V-span forward: several independent segments in one pass, no padding.

A segment is what `span.span_forward` runs alone: tokens [n_i] at positions
offset_i..offset_i+n_i-1, attending to its own past K/V (or none) and causally to itself.
`packed_forward` concatenates the segments along tokens ([N, 1, h], N = Σ n_i) and calls
the GPTModel's submodules once per layer for all of them — embedding, norms, QKV, output
projection and MLP are row-wise, so a row's result does not depend on its neighbours — with
RoPE at each row's own position. Only core attention has to keep the segments apart: each
segment's queries see its own past and its own earlier tokens, never another segment's.
That is block-diagonal attention, done one of three ways (`attention=`):

  "segments"  one core-attention call per segment, exactly span_forward's call (its
              span mask, or none for SDPAttention): any core attention, CPU and GPU; the
              work is each segment's own, so the FLOPs are the sum of the segments'.
  "block"     one call over the concatenated keys [past_1, k_1, past_2, k_2, ...] with a
              bool block mask [1, 1, N, K] (True = masked), as megatron's
              DotProductAttention takes it: exact, but it scores all N×K pairs.
  "batched"   one call per layer over a padded batch: segments that share one past object
              (a group's completions after its prompt) form one row of the batch, whose
              keys are that past once and then the segments' own tokens, under a bool
              mask built once per pass; others are a row each. Scores only within a row,
              so a handful of kernel calls and index copies replace one call, one key
              concatenation and one mask per segment per layer — what dominates on a CPU
              (local core attention: it needs an explicit mask).
  "varlen"    CUDA with SDPAttention in fp16/bf16: torch's flash varlen kernel over the
              same concatenated keys with cu_seqlens for queries and keys and causal
              bottom-right alignment (a segment's queries end at its last key): one call,
              only the segments' own pairs.
  "auto"      varlen where it applies, else batched for several segments on SDPAttention,
              else segments.

Returned: the final-normed hidden states [N, 1, h] (None with `stop_after_kv`) and each
segment's K/V per layer, attached to the graph (views of the packed tensors). `lm_head`
turns hidden states into logits; it is the one place the output layer runs, so a fused
LM head can replace it.

Requirements are span_forward's (checked by the same function): local layer spec, no fused
masked softmax, dropout 0, no sequence/context parallelism, plain RoPE. At TP > 1 every TP
rank must pack the same segments (the collectives run once per pass).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from tsync_mcore.model.attention import SDPAttention
from tsync_mcore.model.bridge import unwrap
from tsync_mcore.model.span import KV, check_supported, span_attention, span_mask
from tsync_mcore.platform import upload

__all__ = ["ATTENTION_PATHS", "Segment", "Packed", "packed_forward", "lm_head", "block_mask",
           "batch_layout", "supported"]

ATTENTION_PATHS = ("auto", "segments", "batched", "block", "varlen")


@dataclass
class Segment:
    tokens: Tensor  # [n] token ids
    offset: int  # position of its first token (== its past's length)
    past: list[KV] | None = None  # per layer, K/V of positions 0..offset-1


@dataclass
class Packed:
    hidden: Tensor | None  # [N, 1, h] after the final norm; None with stop_after_kv
    kv: list[list[KV]]  # per segment, per layer: its own tokens' K/V (graph-attached views)
    starts: list[int]  # where each segment's rows begin in the pack

    def rows(self, i: int) -> slice:
        n = len(self.kv[i][0])
        return slice(self.starts[i], self.starts[i] + n)


def supported(model: torch.nn.Module) -> str | None:
    """None when `model` can run packed (and span) forwards, else why not."""
    try:
        check_supported(unwrap(model))
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def block_mask(lengths: list[int], pasts: list[int], device=None) -> Tensor:
    """Megatron bool mask [1, 1, N, K] over keys [past_1, k_1, past_2, k_2, ...], True =
    masked: row t of segment i sees its past and its own tokens up to t."""
    n_q, n_k = sum(lengths), sum(lengths) + sum(pasts)
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    q = k = 0
    for n, p in zip(lengths, pasts):
        mask[q:q + n, k:k + p + n] = span_mask(n, p, device)[0, 0]
        q, k = q + n, k + p + n
    return mask[None, None]


@dataclass
class BatchLayout:
    """The "batched" path's padded layout, built once per pass (slots are s-major: slot
    t·B + b is query (key) t of batch row b)."""

    q_index: Tensor  # [maxq·B] packed row of each query slot (padding: row 0)
    k_index: Tensor  # [maxk·B] row of each key slot in [own keys; pasts' keys] (padding: 0)
    row_slot: Tensor  # [N] the query slot of each packed row
    mask: Tensor  # [B, 1, maxq, maxk] megatron bool, True = masked
    pasts: list[int]  # segments whose past joins the key pool, in pool order
    shape: tuple[int, int, int]  # B, maxq, maxk


def batch_layout(segs: list[Segment], starts: list[int], lengths: list[int],
                 device=None) -> BatchLayout:
    """Rows of the padded batch: segments sharing one past object share a row (the past's
    keys once, then each segment's own keys); every other segment is a row of its own."""
    rows: dict[int, list[int]] = {}
    for i, s in enumerate(segs):
        rows.setdefault(id(s.past) if s.past is not None else -1 - i, []).append(i)
    n_rows, pool, pasts = len(rows), sum(lengths), []
    q_rows, k_rows, masks = [], [], []
    for members in rows.values():
        head = segs[members[0]]
        past_keys = []
        if head.past is not None:
            past_keys = list(range(pool, pool + head.offset))
            pool += head.offset
            pasts.append(members[0])
        qs, ks, allowed = [], list(past_keys), []
        for m in members:
            own0 = len(ks)
            ks.extend(range(starts[m], starts[m] + lengths[m]))
            for t in range(lengths[m]):
                qs.append(starts[m] + t)
                allowed.append((len(past_keys), own0, own0 + t + 1))
        q_rows.append(qs)
        k_rows.append(ks)
        masks.append(allowed)
    maxq, maxk = max(map(len, q_rows)), max(map(len, k_rows))
    q_index = torch.zeros(maxq, n_rows, dtype=torch.long)
    k_index = torch.zeros(maxk, n_rows, dtype=torch.long)
    row_slot = torch.zeros(sum(lengths), dtype=torch.long)
    mask = torch.ones(n_rows, 1, maxq, maxk, dtype=torch.bool)
    mask[:, :, :, 0] = False  # padding queries see one key: no all-masked (NaN) softmax row
    for b, (qs, ks, allowed) in enumerate(zip(q_rows, k_rows, masks)):
        q_index[:len(qs), b] = torch.tensor(qs)
        k_index[:len(ks), b] = torch.tensor(ks)
        for t, (n_past, lo, hi) in enumerate(allowed):
            row_slot[qs[t]] = t * n_rows + b
            mask[b, 0, t, :n_past] = False
            mask[b, 0, t, n_past:] = True
            mask[b, 0, t, lo:hi] = False
    on = lambda x: x if device is None or torch.device(device).type == "cpu" \
        else upload(x.tolist(), x.dtype, torch.device(device))  # noqa: E731
    return BatchLayout(on(q_index.flatten()), on(k_index.flatten()), on(row_slot), on(mask),
                       pasts, (n_rows, maxq, maxk))


def _attend_batched(sa, q: Tensor, k: Tensor, v: Tensor, segs: list[Segment],
                    lay: BatchLayout, layer: int) -> Tensor:
    n_rows, maxq, maxk = lay.shape
    keys = torch.cat([k, *(segs[i].past[layer].k for i in lay.pasts)])
    values = torch.cat([v, *(segs[i].past[layer].v for i in lay.pasts)])
    pad = lambda x, index, n: x.index_select(0, index).view(n, n_rows, *x.shape[2:])  # noqa
    out = sa.core_attention(pad(q, lay.q_index, maxq), pad(keys, lay.k_index, maxk),
                            pad(values, lay.k_index, maxk), lay.mask,
                            attn_mask_type=sa.attn_mask_type)  # [maxq, B, np·hn]
    return out.reshape(maxq * n_rows, -1).index_select(0, lay.row_slot)[:, None]


def _varlen_ok(core, q: Tensor) -> bool:
    if not (q.is_cuda and isinstance(core, SDPAttention)
            and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _path(core, q: Tensor, segs: list[Segment], path: str) -> str:
    if path != "auto":
        return path
    if _varlen_ok(core, q):
        return "varlen"
    # SDPA only: megatron's core materialises every score anyway, and its executed FLOPs
    # are the ledger's (padding would add to them)
    return "batched" if isinstance(core, SDPAttention) and len(segs) > 1 else "segments"


def _attend(sa, q: Tensor, k: Tensor, v: Tensor, segs: list[Segment], starts: list[int],
            lengths: list[int], layer: int, path: str, lay: BatchLayout | None) -> Tensor:
    """Block-diagonal core attention of the packed q/k/v [N, 1, heads, hn] -> [N, 1, np·hn]."""
    core = sa.core_attention
    if path == "batched":
        if not isinstance(core, (SDPAttention, DotProductAttention)):
            raise ValueError(f"attention path 'batched' needs a local core attention (an "
                             f"explicit mask), not {type(core).__name__}")
        return _attend_batched(sa, q, k, v, segs, lay, layer)
    pasts = [s.past[layer] if s.past is not None else None for s in segs]
    if path == "segments":  # each segment exactly as span_forward attends (TE cores too)
        out = []
        for a, n, s, p in zip(starts, lengths, segs, pasts):
            kk, vv = k[a:a + n], v[a:a + n]
            if p is not None:
                kk, vv = torch.cat([p.k, kk]), torch.cat([p.v, vv])
            out.append(span_attention(core, q[a:a + n], kk, vv, s.offset))
        return out[0] if len(out) == 1 else torch.cat(out)
    keys, values = [], []
    for a, n, p in zip(starts, lengths, pasts):
        if p is not None:
            keys.append(p.k)
            values.append(p.v)
        keys.append(k[a:a + n])
        values.append(v[a:a + n])
    keys, values = torch.cat(keys), torch.cat(values)
    if path == "block":
        if not isinstance(core, (SDPAttention, DotProductAttention)):
            raise ValueError(f"attention path 'block' needs a local core attention (an "
                             f"explicit mask), not {type(core).__name__}")
        mask = block_mask(lengths, [s.offset for s in segs], q.device)
        return core(q, keys, values, mask, attn_mask_type=sa.attn_mask_type)
    if path != "varlen":
        raise ValueError(f"attention path must be one of {ATTENTION_PATHS}, got {path!r}")
    if not _varlen_ok(core, q):
        raise ValueError("attention path 'varlen' needs CUDA, SDPAttention and fp16/bf16")
    from torch.nn.attention.varlen import varlen_attn
    lens_k = [n + s.offset for n, s in zip(lengths, segs)]
    cu = lambda xs: upload([0, *itertools.accumulate(xs)], torch.int32, q.device)  # noqa: E731
    heads = q.shape[2]
    out = varlen_attn(q[:, 0], keys[:, 0], values[:, 0], cu(lengths), cu(lens_k),
                      max(lengths), max(lens_k), scale=core.softmax_scale,
                      window_size=(-1, 0), enable_gqa=keys.shape[2] != heads)
    return out.reshape(q.shape[0], 1, heads * q.shape[3])


def packed_forward(model: torch.nn.Module, segments: list[Segment], *, attention: str = "auto",
                   stop_after_kv: bool = False) -> Packed:
    """Run every segment as `span_forward` would alone, in one pass (see the module doc)."""
    gpt = unwrap(model)
    check_supported(gpt)
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
    layers = gpt.decoder.layers
    if not segments:
        raise ValueError("packed_forward needs at least one segment")
    lengths, starts = [], []
    for i, s in enumerate(segments):
        if s.tokens.dim() != 1 or s.tokens.numel() == 0:
            raise ValueError(f"segment {i}: tokens must be a non-empty 1-D tensor, got "
                             f"{tuple(s.tokens.shape)}")
        if s.past is None:
            if s.offset != 0:
                raise ValueError(f"segment {i}: past is None but offset is {s.offset}")
        elif len(s.past) != len(layers) or any(len(x) != s.offset or len(x.v) != s.offset
                                               for x in s.past):
            raise ValueError(f"segment {i}: past must hold {len(layers)} layers of {s.offset} "
                             f"tokens, got {[(len(x), len(x.v)) for x in s.past]}")
        starts.append(sum(lengths))
        lengths.append(s.tokens.numel())
    cfg = gpt.config
    ids = torch.cat([s.tokens for s in segments])
    x = gpt.embedding(input_ids=ids[None], position_ids=None)  # [N, 1, h]
    # Each row's RoPE angle at its own position: rotary_pos_emb(n, offset) per segment.
    freqs = torch.cat([gpt.rotary_pos_emb(s.tokens.numel(), offset=s.offset) for s in segments])
    kv: list[list[KV]] = [[] for _ in segments]
    path = _path(layers[0].self_attention.core_attention, x, segments, attention)
    lay = batch_layout(segments, starts, lengths, x.device) if path == "batched" else None
    for i, layer in enumerate(layers):
        sa = layer.self_attention
        residual = x
        q, k, v = sa.get_query_key_value_tensors(layer.input_layernorm(x))
        rope = dict(config=cfg, cp_group=sa.pg_collection.cp)
        k = rope_utils.apply_rotary_pos_emb(k, freqs, **rope).contiguous()
        v = v.contiguous()
        for j, (a, n) in enumerate(zip(starts, lengths)):
            kv[j].append(KV(k[a:a + n], v[a:a + n]))
        if stop_after_kv and i == len(layers) - 1:
            return Packed(None, kv, starts)
        q = rope_utils.apply_rotary_pos_emb(q, freqs, **rope)
        ctx = _attend(sa, q, k, v, segments, starts, lengths, i, path, lay)
        x = layer.self_attn_bda(layer.training, cfg.bias_dropout_fusion)(
            sa.linear_proj(ctx), residual, layer.hidden_dropout)
        mlp = layer.mlp(layer.pre_mlp_layernorm(x))
        x = layer.mlp_bda(layer.training, cfg.bias_dropout_fusion)(mlp, x, layer.hidden_dropout)
    return Packed(gpt.decoder.final_layernorm(x), kv, starts)


def lm_head(model: torch.nn.Module, hidden: Tensor) -> Tensor:
    """Logits [N, V_local] (this rank's vocabulary shard) of final-normed hidden [N, 1, h]."""
    gpt = unwrap(model)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else None
    logits, _ = gpt.output_layer(hidden, weight=weight)
    return logits[:, 0]
