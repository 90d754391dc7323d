"""FlopCounterMode on the real Megatron model, for tests/test_ledger.py.

`measure_cases` runs in process (TP=1, the test's `parallel1`) and on torchrun ranks:
    torchrun --nproc-per-node 2 tests/helpers/workers/ledger_worker.py '<json config>'
config: {"tp": 2, "jobs": [job, ...]}, a job {"ckpts": {name: dir}, "seq_lens": [[...], ...]}
and optionally "lora": {"rank": r, "targets": [...]} (LoRA adapters instead of the freeze
cases); each rank prints one `RESULT {json}` line with its counted FLOPs per job, then
(checkpoint, case, lengths): one launch for the freeze cases and the LoRA policies.
"""

from __future__ import annotations

import json
import sys

import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch.utils.flop_counter import FlopCounterMode

from tsync_mcore.model import bridge  # noqa: E402
from tsync_mcore.observability.ledger.flops import frozen_names  # noqa: E402


def freeze_case(model: torch.nn.Module, spec: bridge.ModelSpec, case: str) -> frozenset[str]:
    """Set requires_grad per `case`; return the frozen names (for the ledger).

    none: all trainable. linear_but_one: every linear weight (QKV, proj, fc1, fc2, output)
    frozen except layer 0's fc2; norms/embedding/biases trainable. all_but_one: everything
    frozen except the last layer's attention output projection (no grad reaches layer 0..).
    """
    last = spec.layers - 1
    keep = {
        "none": None,
        "linear_but_one": "decoder.layers.0.mlp.linear_fc2.weight",
        "all_but_one": f"decoder.layers.{last}.self_attention.linear_proj.weight",
    }[case]
    linear = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
              "linear_fc2.weight", "output_layer.weight")  # fmt: skip
    for name, p in model.named_parameters():
        if case == "none" or name == keep:
            p.requires_grad_(True)
        elif case == "linear_but_one":
            p.requires_grad_(not name.endswith(linear))
        else:
            p.requires_grad_(False)
    return frozen_names(model)


def count(model: torch.nn.Module, spec: bridge.ModelSpec, seq_lens: list[int]) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of the sequences, a log-softmax loss, one backward."""
    gen = torch.Generator().manual_seed(sum(seq_lens))
    with FlopCounterMode(display=False) as fc:
        loss = torch.zeros(())
        for s in seq_lens:  # why: one forward per sequence, as the learner runs sources
            tok = torch.randint(0, spec.vocab_size, (1, s), generator=gen)
            lg = bridge.logits(model, tok)
            loss = loss + vocab_parallel_cross_entropy(lg.float(), tok).sum()
        fwd = fc.get_total_flops()
        loss.backward()
        total = fc.get_total_flops()
    model.zero_grad(set_to_none=True)
    return fwd, total


CASES = ("none", "linear_but_one", "all_but_one")


def measure_cases(hf_dir: str, seq_lens_list: list[list[int]]) -> list[dict]:
    """Counted FLOPs for every freeze case x lengths on a freshly built model."""
    model, spec = bridge.build_model(hf_dir)
    out = []
    for case in CASES:
        frozen = sorted(freeze_case(model, spec, case))
        for lens in seq_lens_list:
            fwd, total = count(model, spec, lens)
            out.append({"case": case, "seq_lens": lens, "frozen": frozen,
                        "forward": fwd, "total": total})  # fmt: skip
    return out


def measure_lora(hf_dir: str, seq_lens_list: list[list[int]], rank: int,
                 targets: list[str]) -> list[dict]:
    """Counted FLOPs of a LoRA model (model/lora.py: frozen base, adapters on `targets`)."""
    from tsync_mcore.model import lora

    model, spec = bridge.build_model(hf_dir)
    lora.attach(model, spec, lora.LoraSpec(rank, 2.0 * rank, tuple(targets)), seed=0)
    sizes = {"params": sum(p.numel() for p in model.parameters()),
             "adapter_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    out = []
    for lens in seq_lens_list:
        fwd, total = count(model, spec, lens)
        out.append({"case": "lora", "seq_lens": lens, "forward": fwd, "total": total, **sizes})
    return out


def main(cfg: dict) -> None:
    from tests.helpers.dist_util import report
    from tsync_mcore.model.parallel import init_parallel

    info = init_parallel(tp_size=cfg["tp"])
    jobs = []
    for job in cfg["jobs"]:
        if job.get("lora"):
            lo = job["lora"]
            jobs.append({name: measure_lora(d, job["seq_lens"], lo["rank"], lo["targets"])
                         for name, d in job["ckpts"].items()})
        else:
            jobs.append({name: measure_cases(d, job["seq_lens"])
                         for name, d in job["ckpts"].items()})
    report({"tp_rank": info.tp_rank, "tp_size": info.tp_size, "jobs": jobs})


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main(json.loads(sys.argv[1]))
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
