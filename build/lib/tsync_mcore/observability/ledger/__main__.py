"""`python -m tsync_mcore.observability.ledger --model HF_DIR --seq-lens 128,512 [--scored 40,100] [--json]`

FLOPs of one forward + backward of the given sequences (whole model; `--tp N` adds what one
of N tensor-parallel ranks executes; `--lora-rank R` counts a LoRA policy: frozen base, the
adapters' own products; a Qwen3-MoE checkpoint counts its experts on the top-k routed tokens
of every token, which is the exact total under dropless routing). Parameter and accumulator
sizes: `python -m tsync_mcore.observability.ledger.sizes`.
"""

from __future__ import annotations

import argparse
import json
import sys

from tsync_mcore.observability.ledger.flops import (ATTENTION_MODES, LORA_TARGETS, LoraShape, load_spec,
                                      train_flops)
from tsync_mcore.observability.ledger.moe import MoeShape
from tsync_mcore.util.safe_files import BadFile


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tsync_mcore.observability.ledger", description=__doc__)
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint dir (config.json)")
    ap.add_argument("--seq-lens", required=True, type=_ints, help="e.g. 128,512")
    ap.add_argument("--scored", type=_ints, default=None,
                    help="positions per sequence that go through the vocab projection")
    ap.add_argument("--attention", choices=ATTENTION_MODES, default="full",
                    help="attention FLOPs counted over the full S×S scores or the causal half "
                         "(default full)")
    ap.add_argument("--tp", type=int, default=1, help="also report per-rank FLOPs at this TP")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full weights)")
    ap.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                    help="projections with an adapter (default all seven)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.scored is not None and len(args.scored) != len(args.seq_lens):
        ap.error(f"--scored needs one count per sequence ({len(args.seq_lens)})")
    try:
        spec = load_spec(args.model)
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        lora = LoraShape(args.lora_rank, targets) if args.lora_rank else None
        b = train_flops(spec, args.seq_lens, attention=args.attention,
                        logits_positions=args.scored, lora=lora)
    except (BadFile, ValueError) as e:  # a damaged model dir, a bad LoRA: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    moe = MoeShape.of(spec)
    out = {
        "model": args.model, "arch": spec.arch, "seq_lens": args.seq_lens,
        "scored": args.scored, "attention": args.attention,
        "lora": {"rank": lora.rank, "targets": list(lora.targets)} if lora else None,
        # experts on top_k routed tokens each (dropless): no forward needed for the total
        "moe": {"experts": moe.experts, "top_k": moe.top_k, "expert_ffn": moe.ffn} if moe else None,
        **b.to_dict(),
    }  # fmt: skip
    if args.tp > 1:
        r = b.per_rank(args.tp)
        out.update(tp=args.tp, per_rank_total_flops=r.total)
    if args.json:
        print(json.dumps(out))
        return 0
    where = f" lora r={lora.rank} on {','.join(lora.targets)}" if lora else ""
    if moe:
        where += f" moe {moe.experts} experts top-{moe.top_k}"
    print(f"{spec.arch} seq_lens={args.seq_lens} attention={args.attention}{where}")
    for key in ("forward_flops", "backward_flops", "total_flops"):
        print(f"  {key:16s} {out[key]:.6e}")
    if args.tp > 1:
        print(f"  per rank (tp={args.tp}) {out['per_rank_total_flops']:.6e}")
    return 0


if __name__ == "__main__":
    from tsync_mcore.util import quiet
    quiet.install()
    sys.exit(main())
