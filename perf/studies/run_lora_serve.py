"""vLLM serving a LoRA adapter (publish.lora: adapter) against the merged weights.

One engine started with LoRA on, over a random tiny checkpoint and a random PEFT adapter
(peft's own save, A and B non-zero): the same seeded batch is generated on the base
weights with no adapter, then through the adapter (`RolloutEngine.load_adapter`, timed),
best of `--repeats`; with the bytes an adapter publication sends against a whole one.

    python -m perf.studies.run_lora_serve                      # hidden 256, r = 8
    python -m perf.studies.run_lora_serve --rank 64 --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _adapter(base: str, out: str, rank: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                          target_modules="all-linear"))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.02)
    pm.save_pretrained(out)


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if f.endswith(".safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tsync_mcore.rollout.engine import EngineThread, RolloutEngine
    from tsync_mcore.model.tiny import make_tiny_checkpoint

    root = tempfile.mkdtemp(prefix="lora_serve_")
    base = make_tiny_checkpoint(os.path.join(root, "base"), vocab_size=512,
                                hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                                kv_heads=max(1, args.hidden // 128),
                                intermediate=2 * args.hidden)
    ad = os.path.join(root, "adapter")
    _adapter(base, ad, args.rank)
    et = EngineThread()

    async def make():
        return RolloutEngine(base, max_model_len=256, lora_rank=args.rank)

    eng = et.run(make())
    et.run(eng.warmup())
    prompts = [[(7 * i + j) % 500 + 1 for j in range(12)] for i in range(args.requests)]

    async def batch():
        return await asyncio.gather(*[eng.generate(p, max_tokens=args.tokens, seed=i)
                                      for i, p in enumerate(prompts)])

    def best() -> float:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            et.run(batch())
            times.append(time.perf_counter() - t0)
        return min(times)

    base_s = best()
    load_s = et.run(eng.load_adapter(ad))
    lora_s = best()
    et.run(eng.aclose())
    et.close()
    print(json.dumps({"rank": args.rank, "hidden": args.hidden, "layers": args.layers,
                      "requests": args.requests, "tokens": args.tokens,
                      "base_batch_s": round(base_s, 3), "adapter_batch_s": round(lora_s, 3),
                      "adapter_over_base": round(lora_s / base_s, 2),
                      "load_adapter_s": round(load_s, 3),
                      "adapter_bytes": _bytes(ad), "model_bytes": _bytes(base)}))


if __name__ == "__main__":
    main()
