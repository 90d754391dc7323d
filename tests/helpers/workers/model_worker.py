"""Multi-rank model checks (and the K/V-span forward's), launched by
tests/integration/test_model.py through dist_util.run_dist.

Usage: torchrun --nproc-per-node 2 tests/helpers/workers/model_worker.py '<json config>'
config: {"tp2": {"ckpts": {name: dir}, "bad_vocab": dir}, "dp2": {"ckpt": dir},
         "span": span_worker.check_tp2's config}
Prints one `RESULT {json}` line per rank.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.model import bridge, optimizer  # noqa: E402
from tsync_mcore.model.parallel import init_parallel  # noqa: E402


def _hf(hf_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)


def check_tp2(cfg: dict) -> dict:
    """TP=2 logits vs HF, export round trip, vocab % tp error."""
    info = init_parallel(tp_size=2)
    out: dict = {"tp_rank": info.tp_rank, "tp_size": info.tp_size}
    for name, path in cfg["ckpts"].items():
        model, spec = bridge.build_model(path)
        ddp = optimizer.wrap_ddp(model, use_distributed_optimizer=False)  # DP=1: TP-grad sync only
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, spec.vocab_size, (2, 19), generator=gen)
        weight = torch.randn(2, 19, spec.vocab_size, generator=gen)
        local = bridge.logits(ddp, tokens)
        # grads of L = sum(logits * weight): each TP rank backprops its vocab shard's part
        v = local.shape[-1]
        (local * weight[..., info.tp_rank * v : (info.tp_rank + 1) * v]).sum().backward()
        shards = [torch.empty_like(local) for _ in range(info.tp_size)]
        dist.all_gather(shards, local.detach().contiguous(), group=info.tp_group)
        full = torch.cat(shards, dim=-1)
        hf = _hf(path)
        ref = hf(tokens).logits
        (ref * weight).sum().backward()
        raw = bridge.export_hf(
            {n: p.main_grad for n, p in ddp.named_parameters()}, spec, tp_partial_grads=True
        )
        optimizer.finish_grad_sync(ddp)
        grads = bridge.export_hf({n: p.main_grad for n, p in ddp.named_parameters()}, spec)
        hf_grads = {n: p.grad for n, p in hf.named_parameters()}
        exported = bridge.export_hf_state_dict(ddp, spec)  # "module." prefix stripped
        original = bridge.load_hf_state_dict(path)
        out[name] = {
            "local_vocab": v,
            "logits_err": (full - ref.detach()).abs().max().item(),
            "grad_rel_err": max(
                ((grads[n] - hf_grads[n]).abs().max() / hf_grads[n].abs().max()).item()
                for n in grads
            ),
            "grad_names_ok": sorted(grads) == sorted(original),
            "raw_grads_equal_synced": all(torch.equal(raw[n], grads[n]) for n in grads),
            "export_names_equal": list(exported) == bridge.hf_param_names(spec)
            and sorted(exported) == sorted(original),
            "export_exact": all(torch.equal(exported[k], original[k]) for k in original),
        }
    # bf16 shards gather over gloo too
    path = cfg["ckpts"]["qwen3"]
    m16, spec = bridge.build_model(path, dtype=torch.bfloat16)
    exp16 = bridge.export_hf_state_dict(m16, spec)
    out["bf16_export_exact"] = all(
        torch.equal(exp16[k], t.to(torch.bfloat16))
        for k, t in bridge.load_hf_state_dict(path).items()
    )
    # RNG tracker: the model-parallel stream differs per TP rank, the data-parallel one not
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        tp_draw = torch.rand(4)
    with tracker.fork(tensor_parallel.get_data_parallel_rng_tracker_name()):
        dp_draw = torch.rand(4)
    draws = [torch.empty(8) for _ in range(info.tp_size)]
    dist.all_gather(draws, torch.cat([tp_draw, dp_draw]), group=info.tp_group)
    out["tp_streams_differ"] = not torch.equal(draws[0][:4], draws[1][:4])
    out["dp_streams_equal"] = torch.equal(draws[0][4:], draws[1][4:])
    try:
        bridge.build_model(cfg["bad_vocab"])
        out["bad_vocab_error"] = None
    except ValueError as e:
        out["bad_vocab_error"] = str(e)
    return out


def _nll(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL (TP=1: the logits hold the full vocabulary)."""
    out = bridge.logits(model, tokens[:, :-1]).float()
    return F.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


def _flat_ref(ddp, ref_grads: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Reference grads laid out like the DDP grad buffers."""
    flats = [torch.zeros_like(b) for b in optimizer.grad_buffers(ddp)]
    names = {p: n for n, p in ddp.module.named_parameters()}
    for flat, buf in zip(flats, ddp.buffers):
        for param, (start, end, _) in buf.param_index_map.items():
            flat[start:end] = ref_grads[names[param]].flatten()
    return flats


def _check_ddp(path: str, info, *, dist_opt: bool, dtype: torch.dtype, seqs: list) -> dict:
    model, spec = bridge.build_model(path, dtype=dtype)
    ddp = optimizer.wrap_ddp(model, use_distributed_optimizer=dist_opt)
    ddp.zero_grad_buffer()
    _nll(ddp, seqs[info.dp_rank]).backward()
    bufs = optimizer.grad_buffers(ddp)
    local = [b.clone() for b in bufs]
    optimizer.finish_grad_sync(ddp)
    # expected: SUM of both ranks' pre-sync buffers
    expected = []
    for t in local:
        parts = [torch.empty_like(t) for _ in range(info.dp_size)]
        dist.all_gather(parts, t, group=info.dp_group)
        expected.append(sum(parts))
    # reference: both sequences' grads recomputed on this rank with a plain fp32 model
    ref_model, _ = bridge.build_model(path)
    for seq in seqs:
        _nll(ref_model, seq).backward()
    ref = _flat_ref(ddp, {n: p.grad for n, p in ref_model.named_parameters()})
    sum_err = ref_err = 0.0
    for buf, exp, rf, ranges in zip(bufs, expected, ref, optimizer.reduced_grad_ranges(ddp)):
        for a, b in ranges:
            sum_err = max(sum_err, (buf[a:b] - exp[a:b]).abs().max().item())
            ref_err = max(ref_err, (buf[a:b] - rf[a:b]).abs().max().item())
    ref_scale = max(r.abs().max().item() for r in ref)
    ref_norm = torch.cat([r.flatten() for r in ref]).norm().item()

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # bf16 spacing near 1.0 is 2^-7: a 1e-3 Adam step would not move the norm weights
    lr = 1e-2 if dtype == torch.bfloat16 else 1e-3
    opt = optimizer.build_optimizer(ddp, lr=lr, clip_grad=1.0, bf16=dtype == torch.bfloat16,
                                use_distributed_optimizer=dist_opt)
    ok, grad_norm = optimizer.optimizer_step(opt)
    changed = all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    parts = [torch.empty_like(flat) for _ in range(info.dp_size)]
    dist.all_gather(parts, flat, group=info.dp_group)
    # reference Adam step (torch) on the summed, clipped grads of the fp32 reference model
    adam_err = None
    if dtype == torch.float32:
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ropt = torch.optim.Adam(ref_model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
        ropt.step()
        refp = dict(ref_model.named_parameters())
        adam_err = max((p - refp[n]).abs().max().item() for n, p in model.named_parameters())
    return {
        "grad_dtypes": sorted({str(b.dtype) for b in bufs}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "flat_numel": optimizer.flat_grad_numel(ddp),
        "n_params": sum(p.numel() for p in model.parameters()),
        "sum_err": sum_err,
        "ref_err": ref_err,
        "ref_scale": ref_scale,
        "ok": ok,
        "grad_norm": grad_norm,
        "ref_norm": ref_norm,
        "changed": changed,
        "same_across_ranks": all(torch.equal(parts[0], q) for q in parts),
        "adam_err": adam_err,
    }


def check_dp2(cfg: dict) -> dict:
    """TP=1 x DP=2: SUM reduction into the flat FP32 buffers, optimizer steps."""
    info = init_parallel(tp_size=1)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (1, 24), generator=gen) for _ in range(info.dp_size)]
    out: dict = {"dp_size": info.dp_size, "dp_rank": info.dp_rank}
    cases = {
        "fp32_allreduce": (False, torch.float32),
        "fp32_distopt": (True, torch.float32),
        "bf16_distopt": (True, torch.bfloat16),
    }
    for case, (dist_opt, dtype) in cases.items():
        out[case] = _check_ddp(cfg["ckpt"], info, dist_opt=dist_opt, dtype=dtype, seqs=seqs)
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    result: dict = {}
    if "tp2" in cfg:
        result["tp2"] = check_tp2(cfg["tp2"])
    if "span" in cfg:  # the K/V-span forward's TP = 2 checks (span_worker.py)
        from tests.helpers.workers import span_worker

        result["span"] = span_worker.check_tp2(cfg["span"])
    if "dp2" in cfg:
        result["dp2"] = check_dp2(cfg["dp2"])
    report(result)
    dist.barrier()


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main()
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
