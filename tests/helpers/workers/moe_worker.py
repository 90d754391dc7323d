"""Multi-rank Qwen3-MoE checks, launched by tests/test_moe.py through dist_util.run_dist.

Usage: torchrun --nproc-per-node 2 tests/helpers/workers/moe_worker.py '<json config>'
config: {"ckpt": dir, "odd_experts": dir, "replays": JOBS.json (optional)}. Prints one
`RESULT {json}` line per rank. With "replays", the same launch then runs those replay jobs
as tests/helpers/workers/replay_many_worker.py does (their summaries under "summaries"): one
interpreter, torch and megatron start-up for both.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.helpers.dist_util import report  # noqa: E402
from tests.helpers.moe_reference import grads as hf_grads  # noqa: E402
from tests.helpers.moe_reference import load_hf_moe as _hf
from tsync_mcore.model import bridge, optimizer  # noqa: E402
from tsync_mcore.model.parallel import init_parallel  # noqa: E402


def _batches(vocab: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (tokens [2, 19], logit weights [2, 19, V]) pairs, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (2, 19), generator=gen),
             torch.randn(2, 19, vocab, generator=gen)) for _ in range(n)]


def _export_checks(model, spec, path: str) -> dict:
    exported = bridge.export_hf_state_dict(model, spec)
    original = bridge.load_hf_state_dict(path)
    return {
        "export_names_equal": list(exported) == bridge.hf_param_names(spec)
        and sorted(exported) == sorted(original),
        "export_exact": all(torch.equal(exported[k], original[k]) for k in original),
    }


def check_tp2(cfg: dict) -> dict:
    """TP=2, EP=1: attention and experts split over 2 ranks; logits and export."""
    info = init_parallel(tp_size=2)
    model, spec = bridge.build_model(cfg["ckpt"])
    model.eval()  # megatron refuses MoE training at TP > 1 without sequence parallelism
    tokens, _ = _batches(spec.vocab_size, 1)[0]
    with torch.no_grad():
        local = bridge.logits(model, tokens)
    shards = [torch.empty_like(local) for _ in range(info.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=info.tp_group)
    with torch.no_grad():
        ref = _hf(cfg["ckpt"])(tokens).logits
    fc1 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    return {"tp_size": info.tp_size,
            "logits_err": (torch.cat(shards, -1) - ref).abs().max().item(),
            "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
            "fc1_rows": fc1.shape[0],
            **_export_checks(model, spec, cfg["ckpt"])}


def check_ep2(cfg: dict) -> dict:
    """TP=1, EP=2 over 2 data-parallel ranks: each rank holds half the experts, tokens
    reach them by all-to-all; logits, export, and DDP grads of both ranks' batches."""
    info = init_parallel(tp_size=1, ep_size=2)
    model, spec = bridge.build_model(cfg["ckpt"])
    out: dict = {"dp_size": info.dp_size,
                 "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts)}
    out.update(_export_checks(model, spec, cfg["ckpt"]))
    ddp = optimizer.wrap_ddp(model, use_distributed_optimizer=False)
    expert_buf_params = {p for b in ddp.expert_parallel_buffers for p in b.params}
    out["experts_in_expert_buffers"] = all(
        (p in expert_buf_params) == bridge.is_expert_param(n) for n, p in model.named_parameters())
    batches = _batches(spec.vocab_size, info.dp_size)
    tokens, weight = batches[info.dp_rank]  # a different batch per rank
    ddp.zero_grad_buffer()
    local = bridge.logits(ddp, tokens)
    (local * weight).sum().backward()
    optimizer.finish_grad_sync(ddp)  # dense grads: SUM over DP; expert grads: complete already
    grads = bridge.export_hf({n: p.main_grad for n, p in ddp.named_parameters()}, spec)
    hf = _hf(cfg["ckpt"])
    ref_loss = 0.0
    for i, (t, w) in enumerate(batches):
        ref = hf(t).logits
        if i == info.dp_rank:
            out["logits_err"] = (local.detach() - ref.detach()).abs().max().item()
        ref_loss = ref_loss + (ref * w).sum()
    ref_loss.backward()
    original = bridge.load_hf_state_dict(cfg["ckpt"])
    ref_grads = hf_grads(hf)
    out["grad_names_ok"] = sorted(grads) == sorted(original) == sorted(ref_grads)
    out["grad_rel_err"] = max(
        ((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item() for n in grads)
    try:
        init_parallel(tp_size=1, ep_size=2)
        bridge.build_model(cfg["odd_experts"])
        out["odd_experts_error"] = None
    except ValueError as e:
        out["odd_experts_error"] = str(e)
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = {"tp2": check_tp2(cfg), "ep2": check_ep2(cfg)}
    if cfg.get("ledger_ep"):  # the FLOP ledger at EP = 2 (ledger_moe_ep_worker.py)
        from tests.helpers.workers import ledger_moe_ep_worker

        out["ledger_ep"] = ledger_moe_ep_worker.measure(cfg["ledger_ep"])
    if cfg.get("replays"):
        from tests.helpers.replay import run_jobs
        out["summaries"] = run_jobs(cfg["replays"])
    report(out)


if __name__ == "__main__":
    main()
