"""Shared by the tests of data: tests/unit/test_data.py, tests/integration/test_data.py,
tests/integration/test_data_live.py."""

from __future__ import annotations

import json


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def gsm8k_rows():
    # SkyRL's gsm8k layout (examples/gsm8k/gsm8k_dataset.py): chat prompt, env_class,
    # reward_spec with the ground truth, extra_info.
    qs = [("Tom has 3 apples and buys 4 more. How many?", "7"),
          ("What is 6 times 12?", "72"), ("What is 10 minus 4?", "6")]
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}],
             "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i}} for i, (q, a) in enumerate(qs)]
