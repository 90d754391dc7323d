"""LoRA checks at TP = 2, launched by tests/test_lora.py through dist_util.run_dist.

Usage: torchrun --nproc-per-node 2 tests/workers/lora_worker.py '<json config>'
config: {"adapters": {name: [hf_dir, adapter_dir]}}
Per adapter: the full logits (vocab shards gathered over TP) of a Policy started from the
adapter, and whether export_adapter() gives back the file's tensors exactly. The test
compares the logits with HF + peft on its side. Prints one `RESULT {json}` line per rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_util import report  # noqa: E402

from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.model import bridge  # noqa: E402
from tsync_mcore.model.parallel import init_parallel  # noqa: E402
from tsync_mcore.policy import Policy  # noqa: E402


def main() -> None:
    cfg = json.loads(sys.argv[1])
    info = init_parallel(tp_size=2)
    tokens = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(2))
    out: dict = {"tp_size": info.tp_size, "tokens": tokens.tolist()}
    for name, (hf, ad) in cfg["adapters"].items():
        with open(os.path.join(ad, "adapter_config.json")) as f:
            acfg = json.load(f)
        policy = Policy(load_config(None, {
            "model.hf_dir": hf, "model.tp": 2, "model.lora_init": ad,
            "model.lora.rank": acfg["r"], "model.lora.alpha": float(acfg["lora_alpha"]),
            "model.lora.targets": sorted(acfg["target_modules"])}), par=info)
        with torch.no_grad():
            local = bridge.logits(policy.model, tokens).contiguous()
        shards = [torch.empty_like(local) for _ in range(info.tp_size)]
        dist.all_gather(shards, local, group=info.tp_group)
        exported = policy.export_adapter()  # collective
        want = load_file(os.path.join(ad, "adapter_model.safetensors"))
        out[name] = {
            "logits": torch.cat(shards, dim=-1).tolist(),
            "export_names_equal": sorted(exported) == sorted(want),
            "export_exact": sorted(exported) == sorted(want)
            and all(torch.equal(exported[k], want[k]) for k in want),
        }
        del policy
    report(out)
    dist.barrier()


if __name__ == "__main__":
    main()
