"""FlopCounterMode on each rank of an expert-parallel (EP = 2) Qwen3-MoE forward + backward,
run in tests/helpers/workers/moe_worker.py's launch (tests/integration/test_moe.py), or alone:

Usage: torchrun --nproc-per-node 2 tests/helpers/workers/ledger_moe_ep_worker.py '<json config>'
config: {"ckpt": dir, "shapes": [[b, s] per rank]}. Prints one `RESULT {json}` line per rank:
its counted FLOPs, its sequences and its routing (RoutingCounter, own tokens).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.model import bridge  # noqa: E402
from tsync_mcore.model.parallel import init_parallel  # noqa: E402
from tsync_mcore.observability.ledger import RoutingCounter  # noqa: E402


def measure(cfg: dict) -> dict:
    """This rank's counted FLOPs, sequences and routing (also run in moe_worker.py's launch,
    tests/integration/test_moe.py)."""
    from torch.utils.flop_counter import FlopCounterMode

    init_parallel(tp_size=1, ep_size=2)
    model, spec = bridge.build_model(cfg["ckpt"])
    b, s = cfg["shapes"][dist.get_rank()]
    tokens = torch.randint(0, spec.vocab_size, (b, s),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    with RoutingCounter(model) as rc, FlopCounterMode(display=False) as fc:
        out = bridge.logits(model, tokens)
        fwd = fc.get_total_flops()
        out.float().logsumexp(-1).sum().backward()
        total = fc.get_total_flops()
    return {"forward": fwd, "total": total, "seq_lens": [s] * b, "routing": rc.counts(),
            "attention": bridge.attention_mode(model),
            "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts)}


def main() -> None:
    report(measure(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
