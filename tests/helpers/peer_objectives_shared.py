"""Batches of the peer-objectives tests (unequal groups, uniform ones, a group of one), shared with perf/studies/peer_check.py."""

from __future__ import annotations

import json
import random


def peer_rows(vocab: int, groups: list[tuple[str, int]], seed: int) -> list[dict]:
    """Groups of the given sizes; prompts and continuations of random lengths (unscored
    observation tokens between actions); arrival in a random order."""
    rng = random.Random(seed)
    rows = []
    for g, (kind, m) in enumerate(groups):
        q = rng.randrange(3, 8)
        prompt = [rng.randrange(vocab) for _ in range(q)]
        if kind == "uniform":
            rewards = [0.3] * m
        elif kind == "large":
            rewards = [100.5 + 0.01 * rng.random() for _ in range(m)]
        elif kind == "const":
            rewards = [-2.1] * m
        else:
            rewards = [rng.choice([0.0, 1.0, 0.25]) + rng.random() for _ in range(m)]
        for i in range(m):
            toks, mask = list(prompt), [0] * q
            for _ in range(rng.randrange(1, 4)):
                n_act, n_obs = rng.randrange(1, 8), rng.randrange(0, 4)
                toks += [rng.randrange(vocab) for _ in range(n_act + n_obs)]
                mask += [1] * n_act + [0] * n_obs
            if kind == "mixed" and m == 5 and i == 2:
                mask = [0] * len(toks)  # valid: no scored tokens; still one of B
            rows.append(dict(traj_id=f"g{g}-t{i}", group_id=f"g{g}", tokens=toks,
                             scored_mask=mask, reward=rewards[i], policy_version=0,
                             prompt_len=q))
    order = list(range(len(rows)))
    rng.shuffle(order)
    for r, o in zip(rows, order):
        r["ready_order"] = o
    return rows


def write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)
