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
                             policy_version=version, prompt_len=prompt_len))
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


def make_opd_batch(vocab: int, n_traj: int = 4, turns: int = 3, version: int = 0, seed: int = 0,
                   group_size: int = 2, zero_scored_traj: bool = True,
                   prompt_len: int = 6) -> list[dict]:
    """OPD trajectories: turns of (observation, action); teacher scores on action tokens.

    Turn arrival is interleaved across trajectories (a global random order that keeps each
    trajectory's own turns in order, as a rollout produces them).
    """
    rng = random.Random(seed * 7919 + version)
    rows = []
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)]
               for _ in range((n_traj + group_size - 1) // group_size)]
    for i in range(n_traj):
        # Members of a group share their prompt (part of turn 0, unscored).
        toks, mask, teacher, ends = list(prompts[i // group_size]), [0] * prompt_len, \
            [None] * prompt_len, []
        for j in range(turns):
            n_obs, n_act = rng.randrange(2, 6), rng.randrange(1, 6)
            toks += [rng.randrange(vocab) for _ in range(n_obs + n_act)]
            scored = not (zero_scored_traj and i == n_traj - 1)
            mask += [0] * n_obs + [int(scored)] * n_act
            teacher += [None] * n_obs + [(-rng.uniform(0.05, 6.0) if scored else None)
                                         for _ in range(n_act)]
            ends.append(len(toks))
        rows.append(dict(traj_id=f"v{version}-o{i}", group_id=f"v{version}-p{i // group_size}",
                         tokens=toks, scored_mask=mask, teacher_logprobs=teacher,
                         turn_ends=ends, turn_ready_order=[0] * turns, policy_version=version,
                         prompt_len=prompt_len))
    _interleave(rows, rng)
    return rows


def _interleave(rows: list[dict], rng: random.Random) -> None:
    """Set each row's turn_ready_order: a random global order that keeps each
    trajectory's own turns in order, as a rollout produces them."""
    queue = [[(i, j) for j in range(len(r["turn_ends"]))] for i, r in enumerate(rows)]
    order = 0
    while any(queue):
        q = rng.choice([q for q in queue if q])
        i, j = q.pop(0)
        rows[i]["turn_ready_order"][j] = order
        order += 1


def write_opd_batches(path: str, vocab: int, n_updates: int = 1, seed: int = 0, **kw) -> list[dict]:
    rows = []
    for v in range(n_updates):
        rows += make_opd_batch(vocab, version=v, seed=seed, **kw)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def action_first(rows: list[dict], seed: int = 0) -> list[dict]:
    """The same OPD trajectories cut as "action, then its observation": every turn after the
    first begins with a scored token (as agent loops that cut at each action do). Arrival
    is interleaved anew, each trajectory's turns in order."""
    out = []
    for r in rows:
        m = r["scored_mask"]
        starts = [p for p in range(1, len(m)) if m[p] and not m[p - 1]]
        ends = starts[1:] + [len(m)] if len(starts) > 1 else r["turn_ends"]
        out.append(dict(r, turn_ends=ends, turn_ready_order=[0] * len(ends)))
    _interleave(out, random.Random(seed))
    return out


def with_routing(rows: list[dict], layers: int, topk: int, experts: int, seed: int = 0,
                 odd_prompt: int | None = 0) -> list[dict]:
    """The rows with `routed_experts` as a rollout would send them (every position but the
    last; random distinct experts, not the model's own choice). Members of a group share
    their prompt's routing, as a prompt routed once is, except member 1 of group number
    `odd_prompt` (None: none), whose prompt went to other experts."""
    rng = random.Random(seed)

    def row() -> list[list[int]]:
        return [rng.sample(range(experts), topk) for _ in range(layers)]

    prompts: dict[str, list] = {}
    seen: dict[str, int] = {}
    groups = list(dict.fromkeys(r["group_id"] for r in rows))
    out = []
    for r in rows:
        g = r["group_id"]
        n = len(r["tokens"]) - 1
        q = min(r.get("prompt_len") or 0, n)
        shared = prompts.setdefault(g, [row() for _ in range(q)])
        i = seen[g] = seen.get(g, -1) + 1
        odd = odd_prompt is not None and g == groups[odd_prompt] and i == 1
        prompt = [row() for _ in range(q)] if odd else shared[:q]
        out.append({**r, "routed_experts": prompt + [row() for _ in range(n - q)]})
    return out


def write_rows(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
