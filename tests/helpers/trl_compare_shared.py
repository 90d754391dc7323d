"""The tsync-mcore side of the TRL side-by-side's config, as the unit and integration tests build it."""

from __future__ import annotations

import argparse

import yaml

from perf.studies import trl_compare as tc
from tsync_mcore.config import load_config


def tsync_args(tmp_path, **kw) -> argparse.Namespace:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompt, response, label, meta, **_):\n"
                      "    return float(label in response)\n")
    base = dict(model=str(model), train=str(train), eval="", prompt_key="prompt",
                label_key="answer", reward=f"{reward}:score", updates=3, groups=2,
                group_size=4, max_tokens=8, temperature=1.0, lr=2e-5, seed=7, eval_n=0,
                tsync_schedule="thundersync", tsync_placement="split", tsync_set=[])
    return argparse.Namespace(**{**base, **kw})


def tsync_cfg(tmp_path, sets: dict | None = None, **kw):
    args = tsync_args(tmp_path, **kw)
    doc = tc.tsync_config(args, str(tmp_path / "run"), [0, 1])
    path = tmp_path / "tsync.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_config(str(path), sets or {})
