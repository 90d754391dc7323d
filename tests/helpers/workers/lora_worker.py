"""LoRA checks at TP = 2, launched by tests/test_lora.py through dist_util.run_dist.

Usage: torchrun --nproc-per-node 2 tests/helpers/workers/lora_worker.py '<json config>'
config: {"adapters": {name: [hf_dir, adapter_dir]}, "out": dir, "replays": JOBS.json (optional)}
Per adapter, a Policy started from it: whether export_adapter() gives back the file's
tensors exactly (RESULT), and, written by rank 0 to OUT, the full logits (vocab shards
gathered over TP; logits_{name}.safetensors, tokens in tokens.safetensors) and the merged
HF weights export_params() gives (merged_{name}.safetensors). The test compares logits and
merged weights with HF + peft on its side. Prints one `RESULT {json}` line per rank. With
"replays", the same launch then runs those replay jobs as
tests/helpers/workers/replay_many_worker.py does (their summaries under "summaries"): one
interpreter, torch and megatron start-up for both.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tests.helpers.dist_util import report  # noqa: E402
from tsync_mcore.config import load_config  # noqa: E402
from tsync_mcore.learner.policy import Policy  # noqa: E402
from tsync_mcore.model import bridge  # noqa: E402
from tsync_mcore.model.parallel import init_parallel  # noqa: E402


def main() -> None:
    cfg = json.loads(sys.argv[1])
    info = init_parallel(tp_size=2)
    tokens = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(2))
    out: dict = {"tp_size": info.tp_size}
    if info.rank == 0:
        save_file({"tokens": tokens}, os.path.join(cfg["out"], "tokens.safetensors"))
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
        merged = policy.export_params()  # collective
        if info.rank == 0:  # files, not RESULT lines: the ranks' long lines would interleave
            save_file({k: v.contiguous() for k, v in merged.items()},
                      os.path.join(cfg["out"], f"merged_{name}.safetensors"))
            save_file({"logits": torch.cat(shards, dim=-1)},
                      os.path.join(cfg["out"], f"logits_{name}.safetensors"))
        want = load_file(os.path.join(ad, "adapter_model.safetensors"))
        out[name] = {
            "export_names_equal": sorted(exported) == sorted(want),
            "export_exact": sorted(exported) == sorted(want)
            and all(torch.equal(exported[k], want[k]) for k in want),
        }
        del policy
    if cfg.get("replays"):
        from tests.helpers.replay import run_jobs
        out["summaries"] = run_jobs(cfg["replays"])
    report(out)
    dist.barrier()


if __name__ == "__main__":
    from tests.helpers.dist_util import exit_now

    main()
    exit_now()  # the ranks' results are out: skip the interpreter's teardown
