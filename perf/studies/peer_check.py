"""verl's own loss code against the learner on one batch (docs/design/objectives.md, "Against the peers").

    pip download --no-deps verl==0.9.1 -d /tmp/peers && unzip -q /tmp/peers/verl-*.whl -d /tmp/peers/verl
    PYTHONPATH=/tmp/peers/verl python -m perf.studies.peer_check HF_DIR OUT_DIR

Runs the learner (2 DP ranks, thundersync, balanced routing, adv_std unbiased) for each of
token_mean / seq_mean_token_mean / seq_mean_token_sum_norm, and once configured like
verl's use_kl_loss (low_var_kl), entropy_coeff, clip_ratio_low/high with two PPO
mini-batches (`regularizers_and_ppo`), then takes verl 0.9.1's
`compute_grpo_outcome_advantage` and `agg_loss` (verl/trainer/ppo/core_algos.py) on the
same batch — FP64 per-token log-probs of the HF model, rewards in FP64 and in FP32 — and
prints the relative L2 distance of the gradients. verl is not a dependency: the packages
its module imports but these two functions never call (ray, tensordict, ...) are replaced
by empty modules for this measurement only.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


class _Empty(types.ModuleType):
    """A module whose every attribute is another empty module (usable as a decorator,
    base class or type annotation), for imports the measured functions never use."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        m = _Empty(f"{self.__name__}.{name}")
        m.__path__ = []
        sys.modules[m.__name__] = m
        return m

    def __call__(self, *a, **k):
        return a[0] if a and callable(a[0]) else self

    def __or__(self, other):
        return object

    __ror__ = __or__

    def __mro_entries__(self, bases):
        return (object,)


class _Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAMES = {"ray", "tensordict", "codetiming", "hydra", "pylatexenc", "wandb", "torchdata",
             "peft", "liger_kernel", "flash_attn", "pyarrow", "datasets", "accelerate", "orjson"}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.NAMES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _Empty(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


MODES = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
         "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
H = 40.0


def main(hf: str, out: str) -> None:
    sys.meta_path.insert(0, _Absent())
    import verl.trainer.ppo.core_algos as verl
    from tests.helpers.dist_util import REPO_ROOT, run_dist
    from tests.helpers.reference import rel_l2
    from tests.helpers.peer_objectives_shared import peer_rows, write_rows

    os.makedirs(out, exist_ok=True)
    # no group of one: verl gives it A = r/(1+ε), ours 0 (a documented difference)
    rows = peer_rows(256, [("uniform", 4), ("mixed", 3), ("mixed", 2), ("mixed", 5), ("large", 3)],
                 seed=7)
    batch = write_rows(os.path.join(out, "b.jsonl"), rows)
    cases = [dict(name=n, batch=batch, routing="balanced",
                  overrides={"learner.token_norm": n, "learner.adv_std": "unbiased",
                             "learner.schedule": "thundersync", "learner.k_open": 2,
                             **({"learner.token_norm_constant": H} if n.endswith("norm") else {})})
             for n in MODES]
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f)
    run_dist([os.path.join(REPO_ROOT, "tests/helpers/workers/peer_objectives_worker.py"), hf,
              os.path.join(out, "cases.json"), out], nproc=2, timeout=900)

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64)
    model.get_input_embeddings().padding_idx = None
    params = list(model.named_parameters())
    T = max(len(r["tokens"]) for r in rows) - 1
    lps, mask = [], torch.zeros(len(rows), T, dtype=torch.float64)
    for i, r in enumerate(rows):
        ids = torch.tensor(r["tokens"])
        logits = model(ids[None]).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
        lps.append(torch.nn.functional.pad(lp, (0, T - lp.numel())))
        mask[i, :lp.numel()] = torch.tensor(r["scored_mask"][1:], dtype=torch.float64)
    logp = torch.stack(lps)
    index = np.array([r["group_id"] for r in rows], dtype=object)
    for dtype in (torch.float64, torch.float32):
        rew = torch.zeros(len(rows), T, dtype=dtype)
        rew[:, -1] = torch.tensor([r["reward"] for r in rows], dtype=dtype)
        adv, _ = verl.compute_grpo_outcome_advantage(rew, torch.ones_like(rew), index)
        adv = adv.to(torch.float64)
        for ours, theirs in MODES.items():
            loss_mat = -adv * torch.exp(logp - logp.detach())  # on-policy: ratio 1
            loss = verl.agg_loss(loss_mat, mask, theirs, dp_size=1, batch_num_tokens=mask.sum(),
                                 global_batch_size=len(rows), loss_scale_factor=H)
            g = torch.autograd.grad(loss, [p for _, p in params], retain_graph=True,
                                    allow_unused=True)
            ref = {n: -(x if x is not None else torch.zeros_like(p))
                   for (n, p), x in zip(params, g)}
            got = load_file(os.path.join(out, f"{ours}.safetensors"))
            print(f"verl {theirs}, rewards {str(dtype)[6:]} vs learner {ours}: "
                  f"rel L2 = {rel_l2(got, ref):.2e}", flush=True)


class _VerlActorConfig:
    """What compute_policy_loss_vanilla reads of verl's ActorConfig."""

    def __init__(self, low, high, c, n_tokens, n_rows):
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = low, low, high
        self.clip_ratio_c = c
        self.global_batch_info = dict(dp_size=1, batch_num_tokens=n_tokens,
                                      global_batch_size=n_rows, loss_scale_factor=None)

    def get(self, key, default=None):
        return getattr(self, key, default)


def regularizers_and_ppo(hf: str, out: str) -> None:
    """verl configured with use_kl_loss, kl_loss_type low_var_kl, entropy_coeff,
    clip_ratio_low/high and two PPO mini-batches (loss_agg_mode token-mean) against the
    learner's two steps on the same batch (thundersync, 2 DP ranks, balanced routing):
    each step's gradient from verl's compute_policy_loss_vanilla, kl_penalty and agg_loss,
    at the θ the learner's first step left, old log-probs θ_k's."""
    import verl.trainer.ppo.core_algos as verl
    from tests.helpers.reference import rel_l2
    from tests.helpers.replay import replay
    from tests.helpers.peer_objectives_shared import peer_rows, write_rows
    from tsync_mcore.channel.sources import BatchPlan, TrajectorySource
    from tsync_mcore.learner.minibatch import split

    beta, eta, low, high, c = 0.2, 0.01, 0.2, 0.28, 3.0
    rows = peer_rows(256, [("mixed", 3), ("mixed", 4), ("mixed", 3), ("large", 3)], seed=11)
    batch = write_rows(os.path.join(out, "ppo.jsonl"), rows)
    ref_dir = os.path.join(out, "ref")  # θ_0 perturbed: a reference the KL term pulls to
    ref_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    ref_model.save_pretrained(ref_dir)
    cfg = os.path.join(out, "ppo.yaml")
    with open(cfg, "w") as f:
        f.write(f"learner:\n  kl_coef: {beta}\n  kl_estimator: low_var_kl\n"
                f"  entropy_coef: {eta}\n  reference: {ref_dir}\n  token_norm: token_mean\n"
                f"  adv_std: unbiased\n  minibatches: 2\n  clip_low: {low}\n"
                f"  clip_high: {high}\n  clip_dual: {c}\n  k_open: 2\n"
                f"optim:\n  lr: 1.0\n  eps: 1.0\n")
    run = os.path.join(out, "ppo_run")
    replay(hf, batch, run, 2, "--config", cfg, "--routing", "balanced", "--save-grads", "all")

    def model_at(state=None):
        m = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float64)
        m.get_input_embeddings().padding_idx = None
        if state is not None:
            m.load_state_dict({k: v.double() for k, v in state.items()}, strict=False)
        return m

    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float64)
    theta_k = model_at()
    T = max(len(r["tokens"]) for r in rows) - 1

    def padded(model, r, grad=True):
        ids = torch.tensor(r["tokens"])
        with torch.set_grad_enabled(grad):
            logsm = torch.log_softmax(model(ids[None]).logits[0, :-1], -1)
        lp = logsm.gather(1, ids[1:, None])[:, 0]
        ent = -(logsm.exp() * logsm).sum(-1)
        pad = T - lp.numel()
        return torch.nn.functional.pad(lp, (0, pad)), torch.nn.functional.pad(ent, (0, pad))

    srcs = sorted((TrajectorySource.from_json(dict(r)) for r in rows),
                  key=lambda s: s.ready_order)
    parts = split(BatchPlan.from_sources(srcs), 2)
    index = np.array([r["group_id"] for r in rows], dtype=object)
    rew = torch.zeros(len(rows), T, dtype=torch.float64)
    rew[:, -1] = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    adv_all, _ = verl.compute_grpo_outcome_advantage(rew, torch.ones_like(rew), index)
    for j, part in enumerate(parts, start=1):
        at = model_at(None if j == 1 else
                      load_file(os.path.join(run, f"params_0_mb{j - 1}.safetensors")))
        sel = [i for i, r in enumerate(rows) if r["group_id"] in part]
        lp, ent = zip(*(padded(at, rows[i]) for i in sel))
        old = torch.stack([padded(theta_k, rows[i], grad=False)[0] for i in sel])
        ref_lp = torch.stack([padded(ref, rows[i], grad=False)[0] for i in sel])
        lp, ent = torch.stack(lp), torch.stack(ent)
        mask = torch.zeros(len(sel), T, dtype=torch.float64)
        for k, i in enumerate(sel):
            m = rows[i]["scored_mask"][1:]
            mask[k, :len(m)] = torch.tensor(m, dtype=torch.float64)
        conf = _VerlActorConfig(low, high, c, mask.sum(), len(sel))
        pg, _ = verl.compute_policy_loss_vanilla(old, lp, adv_all[sel], mask, "token-mean", conf)
        info = conf.global_batch_info
        loss = (pg - eta * verl.agg_loss(ent, mask, "token-mean", **info)
                + beta * verl.agg_loss(verl.kl_penalty(lp, ref_lp, "low_var_kl"), mask,
                                       "token-mean", **info))
        params = list(at.named_parameters())
        g = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
        want = {n: -(x if x is not None else torch.zeros_like(p)) for (n, p), x in zip(params, g)}
        got = load_file(os.path.join(run, "grad_0.safetensors" if j == 1
                                     else f"grad_0_mb{j}.safetensors"))
        print(f"verl use_kl_loss low_var_kl + entropy_coeff + clip_ratio_low/high, mini-batch "
              f"{j} of 2 vs learner: rel L2 = {rel_l2(got, want):.2e}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
    regularizers_and_ppo(*sys.argv[1:3])
