"""`python -m tsync_mcore.observability.ledger.sizes [--model HF_DIR | --preset NAME] --ranks 16,64`

Parameters P of a model against the LoRA adapters' P_A, and what the streaming accumulators
hold per rank at most: 4·(2k+1)·P bytes for GRPO, 4·(k+1)·P for OPD (FP32, k =
learner.k_open; docs/design/numerics.md). Counts come from the shapes alone (no weights read); per
TP rank they follow Megatron's layout: base weights and the embedding sharded by tp, norms
replicated; of an adapter, A replicated and B sharded on a column-parallel linear (q/k/v,
gate/up), A sharded and B replicated on a row-parallel one (o, down). DDP's bucket padding
is not included.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from tsync_mcore.observability.ledger.flops import LORA_TARGETS

if TYPE_CHECKING:
    from tsync_mcore.model.bridge import ModelSpec

__all__ = ["PRESETS", "accum_bytes", "adapter_params", "model_params", "preset_spec"]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

# Hugging Face config.json shapes of models worth sizing without downloading them.
PRESETS: dict[str, dict] = {
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, tie_word_embeddings=False),
}


def _demo_config() -> dict:
    from tsync_mcore.model.tiny import DEMO_MODEL as d

    return dict(model_type=d["arch"], vocab_size=d["vocab_size"], hidden_size=d["hidden"],
                num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                num_key_value_heads=d["kv_heads"], intermediate_size=d["intermediate"],
                tie_word_embeddings=False)


def preset_spec(name: str) -> "ModelSpec":
    """ModelSpec of a preset: `demo` (make demo's model) or one of PRESETS."""
    from tsync_mcore.model.bridge import ModelSpec

    return ModelSpec.from_hf_config(_demo_config() if name == "demo" else PRESETS[name])


def _proj_shapes(spec: "ModelSpec") -> dict[str, tuple[int, int]]:
    """HF projection -> (out, in)."""
    h, hd, f = spec.hidden, spec.head_dim, spec.ffn
    q, kv = spec.heads * hd, spec.kv_heads * hd
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}


def model_params(spec: "ModelSpec", tp: int = 1) -> int:
    """Parameters of the model (tp=1), or of one tensor-parallel rank."""
    h, hd = spec.hidden, spec.head_dim
    sharded = sum(o * i for o, i in _proj_shapes(spec).values())
    sharded += (spec.heads + 2 * spec.kv_heads) * hd if spec.qkv_bias else 0
    replicated = 2 * h + (2 * hd if spec.qk_norm else 0)  # input / pre-MLP (and q/k) norms
    vocab = spec.vocab_size * h * (1 if spec.tie else 2)
    return (spec.layers * sharded + vocab) // tp + spec.layers * replicated + h


def adapter_params(spec: "ModelSpec", rank: int, targets=LORA_TARGETS, tp: int = 1) -> int:
    """P_A: LoRA parameters of the model (tp=1), or of one tensor-parallel rank."""
    bad = sorted(set(targets) - set(LORA_TARGETS))
    if bad or rank < 1:
        raise ValueError(f"rank must be >= 1 and targets a subset of {LORA_TARGETS}: "
                         f"got rank {rank}, targets {list(targets)}")
    per_layer = 0
    for t in targets:
        out, inp = _proj_shapes(spec)[t]
        a, b = rank * inp, out * rank
        per_layer += a + b // tp if t in _COLUMN else a // tp + b
    return spec.layers * per_layer


def accum_bytes(params: int, k_open: int, objective: str = "grpo") -> int:
    """The accumulators' bound per rank: (v·k + 1) FP32 vectors of `params` elements, v = 2
    for GRPO's G1'/G2 pairs, 1 for OPD's plain sums."""
    return 4 * ((2 if objective == "grpo" else 1) * k_open + 1) * params


def rows(spec: "ModelSpec", ranks: list[int], targets, k_open: int, tp: int) -> list[dict]:
    p = model_params(spec, tp)
    out = [{"rank": 0, "params": p, "accum_grpo_bytes": accum_bytes(p, k_open),
            "accum_opd_bytes": accum_bytes(p, k_open, "opd")}]
    for r in ranks:
        pa = adapter_params(spec, r, targets, tp)
        out.append({"rank": r, "params": pa, "share": pa / p,
                    "accum_grpo_bytes": accum_bytes(pa, k_open),
                    "accum_opd_bytes": accum_bytes(pa, k_open, "opd")})
    return out


def _size(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for unit, f in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= f:
            return f"{n / f:.2f}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tsync_mcore.observability.ledger.sizes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face checkpoint dir (config.json)")
    src.add_argument("--preset", choices=["demo", *PRESETS], help="a known model's shapes")
    ap.add_argument("--ranks", default="16,64", help="LoRA ranks, comma-separated")
    ap.add_argument("--targets", default=",".join(LORA_TARGETS), help="projections adapted")
    ap.add_argument("--k-open", type=int, default=4, help="learner.k_open (default 4)")
    ap.add_argument("--tp", type=int, default=1, help="per rank at this tensor parallelism")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
        targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
        if args.k_open < 1 or args.tp < 1:
            raise ValueError("--k-open and --tp must be >= 1")
        if args.model:
            from tsync_mcore.observability.ledger.flops import load_spec
            spec = load_spec(args.model)
        else:
            spec = preset_spec(args.preset)
        table = rows(spec, ranks, targets, args.k_open, args.tp)
    except ValueError as e:  # bad numbers, targets, or a damaged config.json (BadFile)
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.model or args.preset
    if args.json:
        print(json.dumps({"model": name, "tp": args.tp, "k_open": args.k_open,
                          "targets": list(targets), "rows": table}))
        return 0
    k = args.k_open
    print(f"{name} ({spec.arch}, {spec.layers} layers, hidden {spec.hidden}), per rank at "
          f"tp={args.tp}, k_open={k}, targets {','.join(targets)}\n")
    print(f"| weights | parameters | share of P | GRPO 4·(2k+1)·P | OPD 4·(k+1)·P |")
    print("|---|---:|---:|---:|---:|")
    for r in table:
        what = "full (P)" if r["rank"] == 0 else f"LoRA r={r['rank']} (P_A)"
        share = "100 %" if r["rank"] == 0 else f"{100 * r['share']:.2f} %"
        print(f"| {what} | {_count(r['params'])} | {share} | {_size(r['accum_grpo_bytes'])} "
              f"| {_size(r['accum_opd_bytes'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
