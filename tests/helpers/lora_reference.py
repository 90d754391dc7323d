"""Independent LoRA references: PEFT adapter fixtures and the FP64 gradient of the adapters.

Plain PyTorch on the Hugging Face model with `peft` attached (float64), no Megatron, no
running sums: the same batch objectives as tests/reference.py (Eq. 6 for GRPO, Eq. 8–9 for
OPD), differentiated with autograd with respect to the adapter parameters only. The result
is keyed by PEFT's saved names (`peft.get_peft_model_state_dict`):
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, `...lora_B.weight`.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.reference import advantages

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # what PEFT picks for Llama/Qwen when none given


def make_peft_adapter(hf_dir: str, out_dir: str, targets=ALL_TARGETS, r: int = 4,
                      alpha: float = 8.0, seed: int = 0, b_std: float = 0.08,
                      use_rslora: bool = False) -> str:
    """A PEFT adapter directory for `hf_dir` with non-zero A and B, saved by peft itself.

    A keeps PEFT's default init (kaiming-uniform, a = √5) drawn under `seed`; B, zero in
    PEFT's init, is drawn N(0, b_std²) so that the adapter changes the model (and the
    gradient of A is not zero)."""
    import peft

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                          lora_dropout=0.0, bias="none", use_rslora=use_rslora)
    model = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(b_std * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.save_pretrained(out_dir)
    return out_dir


def load_peft_model(hf_dir: str, adapter_dir: str, dtype=torch.float64):
    """HF model + the adapter, every parameter in `dtype`; only the adapters train."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    # HF freezes the pad row of the embedding (padding_idx); the objective has no such rule.
    base.get_input_embeddings().padding_idx = None
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    model.to(dtype)  # peft creates the adapter layers in the dtype it reads from the file
    model.eval()  # lora_dropout 0 anyway; no other dropout in these models
    return model


def _token_logp(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], dim=-1)
    return logp.gather(1, ids[1:, None])[:, 0]


def grpo_objective(model, rows: list[dict], objective: str = "grpo",
                   token_norm: str = "trajectory") -> torch.Tensor:
    """J = Σ_G (1/m) Σ_i A_i Σ_{t∈M_i} w_{i,t} log π(a_t | h_t)  (Eq. 6)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    n_scored = sum(sum(r["scored_mask"]) for r in rows)
    J = torch.zeros((), dtype=torch.float64)
    for members in groups.values():
        adv = advantages(torch.tensor([r["reward"] for r in members], dtype=torch.float64),
                         objective)
        for a, r in zip(adv, members):
            mask = torch.tensor(r["scored_mask"][1:], dtype=torch.float64)
            if mask.sum() == 0:
                continue
            w = 1.0 / (len(groups) * mask.sum()) if token_norm == "trajectory" else 1.0 / n_scored
            J = J + a / len(members) * w * (_token_logp(model, r["tokens"]) * mask).sum()
    return J


def opd_objective(model, rows: list[dict]) -> torch.Tensor:
    """Eq. 8–9: whole-sequence forward, A = sg[teacher − student] per scored token, / N."""
    n_scored = sum(sum(r["scored_mask"]) for r in rows)
    J = torch.zeros((), dtype=torch.float64)
    for r in rows:
        mask = torch.tensor(r["scored_mask"][1:], dtype=torch.bool)
        if not mask.any():
            continue
        student = _token_logp(model, r["tokens"])[mask]
        teacher = torch.tensor([t for t, m in zip(r["teacher_logprobs"][1:], mask) if m],
                               dtype=torch.float64)
        J = J + ((teacher - student).detach() * student).sum() / n_scored
    return J


def adapter_grad(model, J: torch.Tensor) -> dict[str, torch.Tensor]:
    """∇J w.r.t. the adapter parameters, keyed by PEFT's saved names."""
    from peft import get_peft_model_state_dict

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert params and all(".lora_" in n for n, _ in params), [n for n, _ in params]
    grads = torch.autograd.grad(J, [p for _, p in params])
    # state_dict= maps the names exactly as save_pretrained does (drops the adapter name)
    by_name = {n: g.detach() for (n, _), g in zip(params, grads)}
    return dict(get_peft_model_state_dict(model, state_dict=by_name))


def reference_lora_grad(hf_dir: str, adapter_dir: str, rows: list[dict],
                        objective: str = "grpo", token_norm: str = "trajectory"
                        ) -> dict[str, torch.Tensor]:
    """FP64 gradient of the batch objective (GRPO family, or "opd") w.r.t. the adapters."""
    model = load_peft_model(hf_dir, adapter_dir)
    if objective == "opd":
        J = opd_objective(model, rows)
    else:
        J = grpo_objective(model, rows, objective, token_norm)
    return adapter_grad(model, J)


def read_adapter(adapter_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors) as saved by peft."""
    import json

    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))


def merge_adapter(hf_dir: str, adapter_dir: str, out_dir: str,
                  dtype=torch.float64) -> str:
    """W + s·B·A written as a plain HF checkpoint (peft's merge_and_unload)."""
    model = load_peft_model(hf_dir, adapter_dir, dtype=dtype).merge_and_unload()
    model.save_pretrained(out_dir)
    return out_dir


def chain_rule_grad(full_grad: dict[str, torch.Tensor], adapter_dir: str
                    ) -> dict[str, torch.Tensor]:
    """The adapter gradient from the full-weight gradient G = ∂J/∂W at the merged weights
    W' = W + s·B·A (an independent route, via tests/reference.py):
    ∂J/∂B = s · G · Aᵀ,  ∂J/∂A = s · Bᵀ · G."""
    cfg, tensors = read_adapter(adapter_dir)
    r = cfg["r"]
    s = cfg["lora_alpha"] / (r ** 0.5 if cfg.get("use_rslora") else r)
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        stem = name[: -len(".lora_A.weight")]
        A, B = t.double(), tensors[stem + ".lora_B.weight"].double()
        G = full_grad[stem.removeprefix("base_model.model.") + ".weight"].double()
        out[stem + ".lora_A.weight"] = s * B.T @ G
        out[stem + ".lora_B.weight"] = s * G @ A.T
    return out
