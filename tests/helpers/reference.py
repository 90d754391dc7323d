"""Independent reference: the batch gradient written directly from Eq. 6 on the HF model.

Plain PyTorch, float64, no Megatron, no running sums: one objective
J = Σ_G (1/m) Σ_i A_i · Σ_{t∈M_i} w_{i,t} log π(a_t | h_t) and autograd.
MoE models run HF's eager per-expert loop; their expert grads come under the fused
in-memory names (tests/moe_reference.py maps them to the checkpoint's).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM


def advantages(rewards: torch.Tensor, objective: str, eps: float = 1e-6) -> torch.Tensor:
    m = rewards.numel()
    if objective == "grpo":
        return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)
    if objective == "dr_grpo":
        return rewards - rewards.mean()
    if objective == "rloo":
        if m < 2:
            return torch.zeros_like(rewards)
        loo = (rewards.sum() - rewards) / (m - 1)
        return rewards - loo
    raise ValueError(objective)


def _own_routing(model, row):
    return nullcontext()


def reference_grad(hf_dir: str, rows: list[dict], objective: str = "grpo",
                   token_norm: str = "trajectory", routing=_own_routing
                   ) -> dict[str, torch.Tensor]:
    """`routing(model, row)`: a context the row's forward runs in (MoE: forced experts)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64,
                                                 experts_implementation="eager")
    model.eval()
    # HF freezes the pad row of the embedding (padding_idx); Eq. 6 has no such exception.
    model.get_input_embeddings().padding_idx = None
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    n_groups = len(groups)
    n_scored = sum(sum(r["scored_mask"]) for r in rows)
    objective_value = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        rewards = torch.tensor([r["reward"] for r in members], dtype=torch.float64)
        adv = advantages(rewards, objective)
        for a, r in zip(adv, members):
            mask = torch.tensor(r["scored_mask"][1:], dtype=torch.float64)
            if mask.sum() == 0:
                continue
            ids = torch.tensor(r["tokens"])
            with routing(model, r):
                logp = torch.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
            token_logp = logp.gather(1, ids[1:, None])[:, 0]
            if token_norm == "trajectory":
                w = 1.0 / (n_groups * mask.sum())
            else:
                w = 1.0 / n_scored
            objective_value = objective_value + a / len(members) * w * (token_logp * mask).sum()
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(objective_value, [p for _, p in model.named_parameters()],
                                allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p))
            for n, g, (_, p) in zip(names, grads, model.named_parameters())}


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    keys = sorted(set(a) & set(b))
    assert keys, "no common tensors"
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in keys)
    den = sum(float((b[k].double() ** 2).sum()) for k in keys)
    return (num / den) ** 0.5


def reference_opd_grad(hf_dir: str, rows: list[dict], routing=_own_routing
                       ) -> dict[str, torch.Tensor]:
    """Eq. 8–9 directly: whole-sequence forward, A = sg[teacher − student], / N_k."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64,
                                                 experts_implementation="eager")
    model.eval()
    model.get_input_embeddings().padding_idx = None
    n_scored = sum(sum(r["scored_mask"]) for r in rows)
    objective_value = torch.zeros((), dtype=torch.float64)
    for r in rows:
        mask = torch.tensor(r["scored_mask"][1:], dtype=torch.bool)
        if not mask.any():
            continue
        ids = torch.tensor(r["tokens"])
        with routing(model, r):
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1], dim=-1)
        student = logp.gather(1, ids[1:, None])[:, 0][mask]
        teacher = torch.tensor([t for t, m in zip(r["teacher_logprobs"][1:], mask) if m],
                               dtype=torch.float64)
        objective_value = objective_value + ((teacher - student).detach() * student).sum() / n_scored
    params = list(model.named_parameters())
    grads = torch.autograd.grad(objective_value, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}


def peer_advantages(rewards: torch.Tensor, objective: str, adv_std: str = "population",
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i with σ population (÷ m) or Bessel-corrected (÷ m − 1); a group of one gets 0
    (torch's unbiased std of one value is NaN, and r − μ is 0 there anyway)."""
    if objective == "grpo" and adv_std == "unbiased":
        if rewards.numel() < 2:
            return torch.zeros_like(rewards)
        return (rewards - rewards.mean()) / (rewards.std(unbiased=True) + eps)
    return advantages(rewards, objective, eps)


def reference_agg_grad(hf_dir: str, rows: list[dict], objective: str = "grpo",
                       token_norm: str = "token_mean", adv_std: str = "population",
                       constant: float = 0.0, eps: float = 1e-6) -> dict[str, torch.Tensor]:
    """∇ of the batch objective in the peers' padded form: a [B, T] matrix of per-token terms
    A_i·log π(a_t|h_t) (on-policy, ratio 1), a [B, T] scored mask, and each mode's
    aggregation of the matrix written out on its own (docs/design/objectives.md):

      token_mean               Σ_{i,t} x / Σ mask                    (verl token-mean, TRL dapo)
      seq_mean_token_mean      (1/B) Σ_i Σ_t x_i / L_i               (verl seq-mean-token-mean)
      seq_mean_token_sum_norm  (1/B) Σ_i Σ_t x_i / H                 (verl seq-mean-token-sum-norm)
      group_scaled_token_mean  Σ_G (1/m_G) Σ_{i∈G} Σ_t x_i / Σ mask
      trajectory               (1/n_groups) Σ_G (1/m_G) Σ_{i∈G} Σ_t x_i / L_i

    B counts every row (also rows with no scored token: they add 0 but count)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64,
                                                 experts_implementation="eager")
    model.eval()
    model.get_input_embeddings().padding_idx = None
    group_of = [r["group_id"] for r in rows]
    groups = sorted(set(group_of))
    adv = torch.zeros(len(rows), dtype=torch.float64)
    size = torch.zeros(len(rows), dtype=torch.float64)  # m_G of each row's group
    for g in groups:
        idx = [i for i, h in enumerate(group_of) if h == g]
        r = torch.tensor([rows[i]["reward"] for i in idx], dtype=torch.float64)
        adv[idx] = peer_advantages(r, objective, adv_std, eps)
        size[idx] = float(len(idx))
    T = max(len(r["tokens"]) for r in rows) - 1
    logp = []
    mask = torch.zeros(len(rows), T, dtype=torch.float64)
    for i, r in enumerate(rows):
        ids = torch.tensor(r["tokens"])
        logits = model(ids[None]).logits[0, :-1]
        lp = torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0]
        logp.append(torch.nn.functional.pad(lp, (0, T - lp.numel())))
        mask[i, :lp.numel()] = torch.tensor(r["scored_mask"][1:], dtype=torch.float64)
    x = adv[:, None] * torch.stack(logp) * mask  # [B, T]
    B, n_tokens, lengths = len(rows), mask.sum(), mask.sum(-1)
    per_row = x.sum(-1)
    safe_len = torch.where(lengths > 0, lengths, torch.ones_like(lengths))
    if token_norm == "token_mean":
        J = x.sum() / n_tokens
    elif token_norm == "seq_mean_token_mean":
        J = (per_row / safe_len).sum() / B
    elif token_norm == "seq_mean_token_sum_norm":
        J = per_row.sum() / (B * constant)
    elif token_norm == "group_scaled_token_mean":
        J = (per_row / size).sum() / n_tokens
    elif token_norm == "trajectory":
        J = (per_row / (size * safe_len)).sum() / len(groups)
    else:
        raise ValueError(token_norm)
    params = list(model.named_parameters())
    grads = torch.autograd.grad(J, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}


def grpo_members(rows: list[dict]):
    """(A_i, row, 1/(n_groups·m_G)) for every member of every group of `rows`, in first-
    appearance order: GRPO advantages and the trajectory norm's group weights of the FP64
    references written per sequence."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    for members in groups.values():
        adv = advantages(torch.tensor([r["reward"] for r in members], dtype=torch.float64),
                         "grpo")
        for a, r in zip(adv.tolist(), members):
            yield a, r, 1.0 / (len(groups) * len(members))


def segments_reference(model, rows, token_norm: str) -> dict:
    """∇ of J = Σ_G Σ_i c_i A_i Σ_s Σ_t log π(seg_s token t) in FP64: each segment its own
    forward; c_i = 1/(n_groups·m·L_i), L_i over all of trajectory i's segments
    ("trajectory"), or 1/N_k ("token_mean")."""
    trajs: dict[str, list[dict]] = {}
    for r in rows:
        trajs.setdefault(r["traj_id"], []).append(r)
    groups: dict[str, list[str]] = {}
    for t, segs in trajs.items():
        groups.setdefault(segs[0]["group_id"], []).append(t)
    n_k = sum(sum(r["scored_mask"]) for r in rows)
    J = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        adv = advantages(torch.tensor([trajs[t][0]["reward"] for t in members],
                                      dtype=torch.float64), "grpo")
        for a, t in zip(adv, members):
            L = sum(sum(r["scored_mask"]) for r in trajs[t])
            c = 1.0 / (len(groups) * len(members) * L) if token_norm == "trajectory" else 1 / n_k
            for r in trajs[t]:
                ids = torch.tensor(r["tokens"])
                logp = torch.log_softmax(model(ids[None]).logits[0, :-1], -1)
                lp = logp.gather(1, ids[1:, None])[:, 0]
                mask = torch.tensor(r["scored_mask"][1:], dtype=torch.float64)
                J = J + c * a * (lp * mask).sum()
    params = list(model.named_parameters())
    grads = torch.autograd.grad(J, [p for _, p in params], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params, grads)}
