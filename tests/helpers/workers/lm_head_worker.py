"""TP = 2 check of the fused LM head (tests/test_lm_head.py): each rank holds half the vocab.

Usage: torchrun --nproc-per-node 2 tests/helpers/workers/lm_head_worker.py [JOBS.json [ENTROPY.json]]
The hidden states pass Megatron's copy-to-TP region (as model/bridge.head_input does), so
their gradient is whole on every rank; each rank reports its log-probs, entropy, the hidden
gradient and its own rows of the weight gradient, in FP64 and FP32, for the test to compare
with the full-vocab reference. Prints one `RESULT {json}` line per rank. With JOBS.json
(tests/helpers/replay.py: write_jobs), the same launch then runs those replays (their
summaries under "summaries"); with ENTROPY.json (entropy_worker.py's job), first the
learner's entropy metric at TP = 2 (under "entropy").
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.kernels import fused_lm_head_logprob  # noqa: E402
from tsync_mcore.model.parallel import init_parallel  # noqa: E402

T, H, V, CHUNK = 37, 16, 300, 10  # CHUNK does not divide T


def problem(dtype: torch.dtype):
    """The same hidden states, weight, targets and upstream gradient on every rank."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(T, H, generator=gen, dtype=torch.float64)
    weight = 0.5 * torch.randn(V, H, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[0], targets[1] = 0, V - 1  # the vocab's edges (one on each rank)
    grad = torch.randn(T, generator=gen, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), targets, grad.to(dtype)


def main(jobs_path: str | None = None, entropy_path: str | None = None) -> None:
    par = init_parallel(tp_size=2)
    group = ps.get_tensor_model_parallel_group()
    v_local = V // par.tp_size
    start = par.tp_rank * v_local
    out = {"tp_rank": par.tp_rank, "start": start, "stop": start + v_local}
    for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
        hidden, weight, targets, grad = problem(dtype)
        h = hidden.clone().requires_grad_()
        w = weight[start:start + v_local].clone().requires_grad_()
        logp, ent = fused_lm_head_logprob(copy_to_tensor_model_parallel_region(h, group=group),
                                          w, targets, start, group, chunk=CHUNK,
                                          with_entropy=True)
        (logp * grad + ent * grad.flip(0)).sum().backward()  # with an entropy bonus's term
        out[name] = {"logp": logp.tolist(), "ent": ent.tolist(), "grad_h": h.grad.tolist(),
                     "grad_w": w.grad.tolist()}
    if entropy_path:  # the learner's entropy metric at TP = 2 (entropy_worker.py)
        import json

        from tests.helpers.workers import entropy_worker
        with open(entropy_path) as f:
            out["entropy"] = entropy_worker.measure(json.load(f))
    if jobs_path:
        from tests.helpers.replay import run_jobs
        out["summaries"] = run_jobs(jobs_path)
    for r in range(par.world_size):  # one rank at a time: long lines on a shared pipe interleave
        if r == par.rank:
            report(out)
        torch.distributed.barrier()


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    import sys

    main(*sys.argv[1:3])
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
