"""The KL term's reference policy π_ref (`learner.reference`, objectives/regularizers.py).

A frozen model on the learner ranks, sharded like the policy (same TP), forwarded without
a graph when a source is served: its scored tokens' log π_ref come with the policy's own
forward, so a streamed source needs nothing the rollout did not send. Three kinds:

    initial + LoRA   the policy's own base with the adapters off (`lora.base_only`): no copy
    initial          model.hf_dir loaded again (θ_0, also after a resume)
    <HF dir>         another checkpoint of the same vocabulary (an SFT model, say)

`learner.reference_update_every` N copies θ into it after every N-th applied update (slime's
`ref_update_interval`). A checkpoint does not hold the reference: a run resumed at update v
takes θ_v, which is the reference an uninterrupted run holds when N divides v (otherwise
θ_{N·⌊v/N⌋} is gone, and it says so). Its bytes and the tokens it forwards are reported (UpdateRecord.reference_bytes,
SourceRecord.reference_tokens; the ledger counts them as forward FLOPs).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import torch

import tsync_mcore.kernels as K
from tsync_mcore.model import bridge, lora
from tsync_mcore.platform import upload


class Reference:
    def __init__(self, cfg, policy):
        self.policy = policy
        self.every = cfg.learner.reference_update_every
        if policy.spec.moe:
            raise ValueError("learner.kl_coef > 0 with a mixture-of-experts model: the "
                             "reference's forwards would run inside the routing replay of the "
                             "policy's; not supported (use kl_coef 0)")
        self.model = None  # None: the policy's base (LoRA), adapters off
        if not (policy.lora is not None and cfg.learner.reference == "initial"):
            path = cfg.model.hf_dir if cfg.learner.reference == "initial" else cfg.learner.reference
            self.model, spec = bridge.build_model(
                path, dtype=next(policy.model.parameters()).dtype, spec=cfg.model.spec,
                attention=cfg.model.attention)
            if spec.vocab_size != policy.spec.vocab_size:
                raise ValueError(f"learner.reference {path!r}: vocabulary of {spec.vocab_size} "
                                 f"tokens, the policy's has {policy.spec.vocab_size}")
            self.model.requires_grad_(False)

    @property
    def nbytes(self) -> int:
        """Bytes of weights it holds on this rank (0: it is the policy's base)."""
        if self.model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.no_grad()
    def logprobs(self, tokens, scored_mask, offset: int = 0) -> torch.Tensor:
        """log π_ref of the scored tokens of `scored_mask[offset:]` (tokens[offset + i] for
        each i with mask[offset + i]), from a forward of the whole sequence, as the policy's
        log-probs dtype; detached."""
        p = self.policy
        ids = upload(list(tokens), torch.long, p.device)
        pos = upload([offset + i for i, m in enumerate(scored_mask[offset:]) if m], torch.long,
                     p.device)
        model = p.ddp if self.model is None else self.model
        ctx = lora.base_only(p.model) if self.model is None else nullcontext()
        with ctx, p._autocast():
            if p.fused_head:
                head = bridge.final_hidden(model, ids[None])
                hidden = head.hidden[0][pos - 1].to(head.weight.dtype)
                out = K.fused_lm_head_logprob(hidden, head.weight, ids[pos],
                                              vocab_start=p.vocab_start, tp_group=p._tp_group,
                                              chunk=p.head_chunk)
            else:
                rows = bridge.logits(model, ids[None])[0][pos - 1]
                out = K.scored_logprob(rows.float() if p.autocasts else rows, ids[pos],
                                       vocab_start=p.vocab_start, tp_group=p._tp_group)
        return out

    def refresh(self, version: int) -> bool:
        """After applied update `version` − 1 (θ is now θ_version): copy θ in every N-th."""
        if not (self.every and self.model is not None and version % self.every == 0):
            return False
        self.copy_policy()
        return True

    def resume(self, version: int) -> None:
        """A run resumed at `version` with a refreshed reference (see the module doc)."""
        if self.model is None:
            return
        self.copy_policy()
        if version % self.every:
            print(f"learner: resumed at update {version}: the reference is θ_{version}, not "
                  f"θ_{self.every * (version // self.every)} of the last refresh (checkpoints "
                  f"do not hold it)", file=sys.stderr, flush=True)

    @torch.no_grad()
    def copy_policy(self) -> None:
        src = dict(bridge.unwrap(self.policy.model).named_parameters())
        for name, p in bridge.unwrap(self.model).named_parameters():
            p.copy_(src[name])
