"""K/V-span checks: shared helpers (imported by tests/test_span.py) and the TP=2 worker.

Usage: torchrun --nproc-per-node 2 tests/helpers/workers/span_worker.py '<json config>'
config: {"ckpts": {name: dir}}. Prints one `RESULT {json}` line per rank.

The streamed gradient here is the reference procedure for per-turn distillation:
(i) each span forward against detached leaves of the earlier spans' K/V, backward of its own
loss (param grads + adjoints on those leaves); (ii) in reverse, recompute each span (but the
last) up to its last K/V and backpropagate them with their accumulated adjoint.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.model import bridge  # noqa: E402
from tsync_mcore.model.span import KV, concat_kv, detached_leaves, span_forward  # noqa: E402


def token_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per row of `logits` [n, V_local]; vocab-parallel at TP > 1.

    Every TP rank returns the same values; each rank backpropagates its copy (megatron's
    convention: the reductions' backward is the identity).
    """
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    # why: megatron's vocab_parallel_cross_entropy casts to fp32, which would hide fp64 errors
    v = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v
    group = ps.get_tensor_model_parallel_group()
    m = logits.detach().max(-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m[:, None]
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1))
    local = (targets >= start) & (targets < start + v)
    picked = shifted.gather(-1, (targets - start).clamp(0, v - 1)[:, None])[:, 0]
    picked = reduce_from_tensor_model_parallel_region(torch.where(local, picked, 0.0))
    return picked - sum_exp.log()


def problem(vocab: int, seq: int, seed: int, dtype: torch.dtype):
    """Random tokens [S], targets [S] and loss coefficients [S] (same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (seq,), generator=gen)
    targets = torch.randint(0, vocab, (seq,), generator=gen)
    coef = torch.randn(seq, generator=gen, dtype=torch.float64).to(dtype)
    return tokens, targets, coef


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def full_grads(model, tokens, targets, coef) -> dict[str, torch.Tensor]:
    """Plain full-sequence backward of L = sum_t coef_t * logp_t."""
    model.zero_grad(set_to_none=True)
    logits = bridge.logits(model, tokens[None])[0]
    (coef * token_logp(logits, targets)).sum().backward()
    return _grads(model)


def _no_phase(name: str) -> ContextManager:
    return contextlib.nullcontext()


def streamed_grads(
    model,
    tokens,
    targets,
    coef,
    bounds: list[int],
    *,
    replay: bool = True,
    phase: Callable[[str], ContextManager] = _no_phase,
) -> dict[str, torch.Tensor]:
    """Same loss, spans [bounds[j], bounds[j+1]) streamed as described in the module doc.

    `phase("turns")` / `phase("replay")` wrap steps (i) / (ii) (e.g. FLOP counters).
    """
    model.zero_grad(set_to_none=True)
    spans = list(zip(bounds, bounds[1:]))
    leaves: list[list[KV]] = []
    with phase("turns"):
        for a, b in spans:
            past = concat_kv(leaves) if leaves else None
            logits, kv = span_forward(model, tokens[a:b], a, past)
            # why: the leaves' .grad accumulate this span's adjoint for every earlier span
            (coef[a:b] * token_logp(logits, targets[a:b])).sum().backward()
            leaves.append(detached_leaves(kv))
    if not replay:
        return _grads(model)
    with phase("replay"):
        for j in range(len(spans) - 2, -1, -1):  # the last span's K/V have no adjoint
            a, b = spans[j]
            past = concat_kv(leaves[:j]) if j else None
            _, kv = span_forward(model, tokens[a:b], a, past, stop_after_kv=True)
            torch.autograd.backward(
                [t for x in kv for t in (x.k, x.v)],
                [t.grad for x in leaves[j] for t in (x.k, x.v)],
            )
    return _grads(model)


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all parameters."""
    diff = torch.cat([(a[n] - b[n]).flatten() for n in b]).norm()
    return (diff / torch.cat([t.flatten() for t in b.values()]).norm()).item()


def forward_err(model, tokens: torch.Tensor, bounds: list[int]) -> tuple[float, int]:
    """Max abs diff of the spans' logits vs bridge.logits on the whole sequence; V_local."""
    with torch.no_grad():
        ref = bridge.logits(model, tokens[None])[0]
        parts: list[list[KV]] = []
        outs = []
        for a, b in zip(bounds, bounds[1:]):
            logits, kv = span_forward(model, tokens[a:b], a, concat_kv(parts) if parts else None)
            parts.append(kv)
            outs.append(logits)
    return (torch.cat(outs) - ref).abs().max().item(), ref.shape[-1]


BOUNDS = [0, 7, 20, 29, 41]


def check_model(path: str, attention: str = "auto") -> dict:
    out: dict = {}
    for dtype, tag in ((torch.float64, "fp64"), (torch.float32, "fp32")):
        model, spec = bridge.build_model(path, dtype=dtype, attention=attention)
        tokens, targets, coef = problem(spec.vocab_size, BOUNDS[-1], 0, dtype)
        out[f"fwd_{tag}"], out["local_vocab"] = forward_err(model, tokens, BOUNDS)
        ref = full_grads(model, tokens, targets, coef)
        out[f"grad_{tag}"] = rel_l2(streamed_grads(model, tokens, targets, coef, BOUNDS), ref)
        if dtype == torch.float64:
            no_replay = streamed_grads(model, tokens, targets, coef, BOUNDS, replay=False)
            out["grad_no_replay"] = rel_l2(no_replay, ref)
    return out


def check_tp2(cfg: dict) -> dict:
    """Every check at TP = 2 (this rank's part): cfg {"ckpts": {name: dir}, "sdpa": [name]}.
    Also run in model_worker.py's launch (tests/integration/test_model.py)."""
    from tsync_mcore.model.parallel import init_parallel

    info = init_parallel(tp_size=2)
    result: dict = {"tp_size": info.tp_size, "tp_rank": info.tp_rank}
    for name, path in cfg["ckpts"].items():
        result[name] = check_model(path)
    for name in cfg.get("sdpa", []):  # SDPAttention (the GPU default) on the same shards
        result[f"{name}_sdpa"] = check_model(cfg["ckpts"][name], attention="sdpa")
    return result


def main() -> None:
    report(check_tp2(json.loads(sys.argv[1])))
    dist.barrier()


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main()
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
