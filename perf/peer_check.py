"""verl's own loss code against the learner on one batch (docs/design/objectives.md, "Against the peers").

    pip download --no-deps verl==0.9.1 -d /tmp/peers && unzip -q /tmp/peers/verl-*.whl -d /tmp/peers/verl
    PYTHONPATH=/tmp/peers/verl:tests:. python perf/peer_check.py HF_DIR OUT_DIR

Runs the learner (2 DP ranks, thundersync, balanced routing, adv_std unbiased) for each of
token_mean / seq_mean_token_mean / seq_mean_token_sum_norm, then takes verl 0.9.1's
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
    from test_peer_objectives import _rows, _write

    os.makedirs(out, exist_ok=True)
    # no group of one: verl gives it A = r/(1+ε), ours 0 (a documented difference)
    rows = _rows(256, [("uniform", 4), ("mixed", 3), ("mixed", 2), ("mixed", 5), ("large", 3)],
                 seed=7)
    batch = _write(os.path.join(out, "b.jsonl"), rows)
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


if __name__ == "__main__":
    main(*sys.argv[1:3])
