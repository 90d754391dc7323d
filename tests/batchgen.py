"""Synthetic GRPO batches in the replay JSON Lines format, with the awkward cases built in.

Each group shares a prompt; each trajectory is prompt + assistant turns interleaved with
unscored observation tokens. Rewards include a uniform group at 0.3 (not a power of two),
a group of large, nearly equal rewards, and a trajectory with an empty scored mask.
"""

from __future__ import annotations

import json
import random


def make_batch(vocab: int, n_groups: int = 4, m: int = 4, version: int = 0, seed: int = 0,
               prompt_len: int = 6, max_len: int = 24) -> list[dict]:
    rng = random.Random(seed * 1000 + version)
    rows = []
    for g in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        if g == 0:
            rewards = [0.3] * m  # uniform, σ = 0: must contribute exactly zero
        elif g == 1:
            rewards = [100.5 + 0.01 * rng.random() for _ in range(m)]  # large, nearly equal
        else:
            rewards = [rng.choice([0.0, 1.0, 0.25, 0.7]) + rng.random() for _ in range(m)]
        for i in range(m):
            toks, mask = list(prompt), [0] * prompt_len
            while len(toks) < rng.randrange(prompt_len + 4, max_len + 1):
                n_act, n_obs = rng.randrange(1, 6), rng.randrange(0, 4)
                toks += [rng.randrange(vocab) for _ in range(n_act + n_obs)]
                mask += [1] * n_act + [0] * n_obs
            if g == n_groups - 1 and i == 0:
                mask = [0] * len(toks)  # valid: no scored tokens, reward still counts
            rows.append(dict(traj_id=f"v{version}-g{g}-t{i}", group_id=f"v{version}-g{g}",
                             tokens=toks, scored_mask=mask, reward=rewards[i],
                             policy_version=version))
    order = list(range(len(rows)))
    rng.shuffle(order)
    for r, o in zip(rows, order):
        r["ready_order"] = o
    return rows


def write_batches(path: str, vocab: int, n_updates: int = 1, seed: int = 0,
                  permute_seed: int | None = None, **kw) -> list[dict]:
    rows = []
    for v in range(n_updates):
        rows += make_batch(vocab, version=v, seed=seed, **kw)
    if permute_seed is not None:  # a different arrival order of the same sources
        prng = random.Random(permute_seed)
        for v in range(n_updates):
            batch = [r for r in rows if r["policy_version"] == v]
            order = list(range(len(batch)))
            prng.shuffle(order)
            for r, o in zip(batch, order):
                r["ready_order"] = o
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows
