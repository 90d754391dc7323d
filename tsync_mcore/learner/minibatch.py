"""PPO mini-batch steps (`learner.minibatches` m > 1; objectives/ppo.py has the math).

The batch's groups split into m mini-batches in registration order (as verl splits a batch
into ppo_mini_batch_size pieces without shuffling). Mini-batch 1 is the update's streamed
part: the queue, the group sums and the deferred scalar run on its groups exactly as a
batch of them would. A source of a later mini-batch is checked when it arrives and its
log-probs under θ_k computed there by a forward without a graph (the old log-probs of
PPO's ratio, and the mismatch guard's weights from them; under sync at close, before the
first step, as a synchronous trainer's separate log-prob pass); at close, after mini-batch 1's
step, each later mini-batch is served — one forward and backward per source under the
current θ, the clipped loss, its own deferred scalar over its groups — and stepped.
Nothing but mini-batch 1 depends on arrival order, so the update sequence is synchronous
PPO's with the same mini-batches.
"""

from __future__ import annotations

import time

import torch

from tsync_mcore.channel.sources import BatchPlan
from tsync_mcore.learner.accumulators import f32
from tsync_mcore.model.packed import Segment
from tsync_mcore.platform import upload
from tsync_mcore.objectives.off_policy import behaviour_at, weighted_logp_sum
from tsync_mcore.objectives.ppo import Clip, ClipStats
from tsync_mcore.observability.trace import DeferredRecord


def split(plan: BatchPlan, m: int) -> list[list[str]]:
    """The plan's groups in m contiguous mini-batches of registration order, sizes
    differing by one at most (the first ones larger)."""
    groups = list(plan.groups)
    q, r = divmod(len(groups), m)
    out, at = [], 0
    for j in range(m):
        n = q + (j < r)
        out.append(groups[at:at + n])
        at += n
    return out


class MiniBatches:
    def __init__(self, learner, plan: BatchPlan, m: int):
        self.ln = learner
        self.parts = split(plan, m)
        self.later = {g for part in self.parts[1:] for g in part}
        self.first = BatchPlan(groups={g: plan.groups[g] for g in self.parts[0]},
                               n_turns=plan.n_turns)
        self.held: dict[str, object] = {}  # later sources given to this rank, by key
        self.pending: list = []  # sync: held sources whose old log-probs wait for close
        self.old: dict[str, torch.Tensor] = {}  # their log π_θk, scored tokens
        self.rho: dict[str, torch.Tensor | None] = {}  # their guard weights (None: 1)
        cfg = learner.cfg
        self.clip = Clip(cfg.clip_low, cfg.clip_high, cfg.clip_dual)
        self.stats = ClipStats()
        # Σ clipped, Σ clipped by the dual bound, Σ (log π_θk − log π_θ): on the device
        self._sums = torch.zeros(3, dtype=torch.float64, device=learner.policy.device)
        self.params: list[dict[str, torch.Tensor]] = []  # θ before steps 2..m, when asked

    def hold(self, src) -> None:
        """A later mini-batch's source given to this rank: its old log-probs now, under θ_k
        (no step runs before close), without a graph — or, under sync, at close (as a
        synchronous trainer computes them after the rollout: verl's compute_log_prob)."""
        self.held[src.key] = src
        if src.n_scored == 0:
            return
        if self.ln.batch.schedule == "sync":
            self.pending.append(src)
            return
        self._old_logprob(src)

    def prepare(self) -> None:
        """At close, before the first step: the old log-probs sync left for now."""
        for src in self.pending:
            self._old_logprob(src)
        self.pending = []

    def _old_logprob(self, src) -> None:
        ln = self.ln
        rec = ln.batch.records[src.key]
        start, cpu0 = ln.now(), time.thread_time()
        with torch.no_grad():
            old = ln.policy.forward_source(list(src.tokens), list(src.scored_mask))
        self.old[src.key] = old
        self.rho[src.key] = ln.off_policy.weights(
            old, behaviour_at(src.behaviour_logprobs, src.scored_mask))
        rec.old_logprob_tokens = len(src.tokens)
        ln.defer(DeferredRecord(update=ln.version, rank=ln.policy.par.rank, work="old_logprob",
                                group_id=src.group_id, traj_id=src.traj_id, ready=rec.ready,
                                start=start, end=ln.now(), cpu=time.thread_time() - cpu0))

    def run(self, export_grad: bool, dropped: set[str]) -> list:
        """Mini-batches 2..m, each served under the θ its predecessor's step left and
        stepped; returns their StepResults (a step that failed ends the update there)."""
        steps = []
        for j, part in enumerate(self.parts[1:], start=2):
            if export_grad:  # where this step's gradient is taken (a collective at TP > 1)
                self.params.append({k: v.detach().float().clone()
                                    for k, v in self.ln.policy.export_params().items()})
            step = self._one(j, [g for g in part if g not in dropped], export_grad)
            steps.append(step)
            if not step.ok:
                break
        return steps

    def _one(self, j: int, groups: list[str], export_grad: bool):
        ln = self.ln
        ln.acc.reset()
        srcs = [ln.batch.plan.groups[g] for g in groups]
        srcs = [self.held[t] for ts in srcs for t in ts if t in self.held]
        for pack in self._passes(srcs):
            self._serve(pack, j)
        scored = sum(s.n_scored for s in srcs)
        ln.acc.fold_direct(ln.policy.grad_buffers(), 1.0)
        ln.policy.zero_grads()
        n_scored = int(ln.policy.dp_sum(scored))
        n_traj = sum(len(ln.batch.plan.groups[g]) for g in groups)
        scale = ln.norm.batch_scale(len(groups), n_traj, n_scored, ln.cfg.token_norm_constant)
        last = j == len(self.parts)
        step = ln.policy.apply_and_step(ln.acc.batch, scale, export_grad=export_grad,
                                        schedule_step=last)
        ln.batch.minibatch_tokens.append(n_scored)
        return step

    def _passes(self, srcs: list) -> list[list]:
        """Sources with scored tokens in packed passes of up to learner.max_tokens_per_pass
        tokens (as mini-batch 1's direct folds and a peer's micro-batches), in order; one
        per pass when packing is off; the rest (nothing to score) alone."""
        budget = self.ln.pack_budget
        out, cur, n = [], [], 0
        for src in srcs:
            if not src.n_scored or not budget:
                out.append([src])
                continue
            if cur and n + src.n_tokens > budget:
                out.append(cur)
                cur, n = [], 0
            cur.append(src)
            n += src.n_tokens
        return out + ([cur] if cur else [])

    def _serve(self, pack: list, j: int) -> None:
        """Sources of mini-batch j in one forward under the current θ: the clipped loss (and
        the KL/entropy term) of each, one backward into the grad buffers."""
        ln = self.ln
        start, cpu0 = ln.now(), time.thread_time()
        if pack[0].n_scored:
            reg = ln.reg.active
            if ln.pack_budget:  # one packed forward
                segments = [Segment(upload(s.tokens, torch.long, ln.policy.device), 0, None)
                            for s in pack]
                scored = [[t for t, m in enumerate(s.scored_mask) if m] for s in pack]
                out = ln.policy.packed_logprobs(segments, scored, with_entropy=reg)
                logps, ents = out[0], (out[1] if reg else [None] * len(pack))
            else:  # a model that cannot run packed forwards, or packing off: alone
                (src,) = pack
                out = ln.policy.forward_source(list(src.tokens), list(src.scored_mask),
                                               with_entropy=reg)
                logps, ents = ([out[0]], [out[1]]) if reg else ([out], [None])
            loss = 0.0
            for src, logp, ent in zip(pack, logps, ents):
                g = src.group_id
                adv = ln.kind.advantage(src)
                w = ln.norm.source_weight(src.scored_in_trajectory) * (
                    1.0 / len(ln.batch.plan.groups[g]) if ln.norm.group_mean else 1.0)
                old = self.old[src.key]
                losses, cut, lower = self.clip.token_losses(logp, old, adv)
                loss = loss + f32(w) * weighted_logp_sum(losses, self.rho[src.key])
                if reg:
                    loss = loss + ln.regularizer(src.tokens, src.scored_mask, 0, logp, ent, w)
                self._count(cut, lower, old - logp.detach())
            loss.backward()
        ln.record_pass([(src, None, dict(span_tokens=src.n_tokens, context=0,
                                         logits=src.n_scored > 0)) for src in pack],
                       start, ln.now(), time.thread_time() - cpu0, minibatch=j)

    def _count(self, cut, lower, neg_kl) -> None:
        s = self.stats
        s.tokens += cut.numel()
        self._sums += torch.stack([cut.sum(dtype=torch.float64),
                                   lower.sum(dtype=torch.float64),
                                   neg_kl.sum(dtype=torch.float64)])

    def figures(self) -> dict:
        """The update's clip figures (one host read), summed over DP ranks."""
        s = self.stats
        tot = self.ln.policy.dp_sum_vector([float(s.tokens), *self._sums.tolist()])
        s.tokens, s.clipped, s.clipped_lower, s.kl_sum = int(tot[0]), int(tot[1]), \
            int(tot[2]), tot[3]
        return s.means()
