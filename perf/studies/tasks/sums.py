"""One-digit sums as a dataset task: `python -m perf.studies.tasks.sums OUT_DIR` writes OUT_DIR/
train.jsonl (64 of the 100 sums a + b, a, b in 0..9, each listed 4 times, shuffled),
OUT_DIR/eval.jsonl (the other 36) and OUT_DIR/reward.py (1 when the answer's last integer
is a + b). The workload of docs/measured/runs.md's real-model section and of
perf/studies/trl_compare.py: a task both trainers read as plain JSONL rows and a reward file."""

from __future__ import annotations

import json
import os
import random
import sys

PROMPT = "What is {a} + {b}? Answer with the number only."
REWARD = '''import re


def score(prompt, response, label, meta, **_):
    """1.0 when the last integer in the answer is the label."""
    nums = re.findall(r"-?\\d+", response)
    return float(bool(nums) and nums[-1] == label.strip())
'''


def rows(seed: int = 0) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    as_row = lambda p: {"prompt": PROMPT.format(a=p[0], b=p[1]), "answer": str(p[0] + p[1])}  # noqa: E731
    train = [as_row(p) for p in pairs[:64]] * 4
    random.Random(seed + 1).shuffle(train)
    return train, [as_row(p) for p in pairs[64:]]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m perf.studies.tasks.sums OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    train, ev = rows()
    for name, rs in (("train.jsonl", train), ("eval.jsonl", ev)):
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    with open(os.path.join(out, "reward.py"), "w") as f:
        f.write(REWARD)
    print(f"ok: {out} (train.jsonl {len(train)} rows, eval.jsonl {len(ev)}, reward.py)")


if __name__ == "__main__":
    main()
