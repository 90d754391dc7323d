"""Packed serving (docs/design/learner.md, "Packed serving").

1. `model/packed.py`: a packed forward of several segments (some with past K/V) against
   separate `span_forward` calls, FP64: logits, K/V, parameter gradients and the adjoints on
   the past leaves, for every attention path that runs on CPU.
2. The learner: packed vs one-by-one service gives the same update (FP32 ≤ 1e-6) for GRPO
   (with and without shared prompts) and OPD under every schedule; what packs and what
   stays one by one; the budget's edge cases; the trace's pass ids and times.
"""

from __future__ import annotations

from tests.helpers.packed_shared import VOCAB  # noqa: F401  (shared with the unit tests)
from tests.helpers.reference import rel_l2  # noqa: E402
from tsync_mcore.observability import trace  # noqa: E402


def test_tensor_parallel_two_ranks(tiny_ckpts, tmp_path):
    """TP = 2 (vocab-parallel head and log-prob, every collective once per pass on both
    ranks): packed == one by one, GRPO with shared prompts and OPD, under sync."""
    from safetensors.torch import load_file

    from tests.helpers.batchgen import write_batches, write_opd_batches
    from tests.helpers.replay import replay_many
    hf_dir = tiny_ckpts["qwen3"]
    grpo, opd = str(tmp_path / "grpo.jsonl"), str(tmp_path / "opd.jsonl")
    write_batches(grpo, VOCAB, n_updates=1, seed=4)
    write_opd_batches(opd, VOCAB, n_updates=1, seed=4, turns=3)
    jobs = {}
    for name, batch, flags in (("grpo", grpo, []), ("opd", opd, ["--objective", "opd"])):
        for pack in ("0", "16384"):
            jobs[f"{name}_{pack}"] = ["--model", hf_dir, "--batch", batch, "--tp", "2",
                                      "--schedule", "sync", "--max-tokens-per-pass", pack,
                                      *flags]
    out = replay_many(jobs, str(tmp_path))
    for name in ("grpo", "opd"):
        one, packed = (load_file(f"{out[f'{name}_{p}']['dir']}/grad.safetensors")
                       for p in ("0", "16384"))
        err = rel_l2(packed, one)
        recs = trace.sources(trace.read(f"{out[f'{name}_16384']['dir']}/trace_rank0.jsonl"))
        print(f"{name} TP=2 packed vs one by one: rel L2 {err:.2e}")
        assert out[f"{name}_16384"]["summary"]["tp"] == 2
        assert err <= 1e-6 and any(r.pass_id is not None for r in recs)
