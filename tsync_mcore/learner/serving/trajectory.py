"""Serving GRPO-family sources: whole trajectories, folded into G1'/G2 or the batch.

A trajectory's service is one forward, fused scored log-prob and backward (against its
group's shared prompt when there is one, `prefix.py`), then a fold: straight into the batch
with its coefficient A_i/m once its group's rewards are all known ("direct"), otherwise
into the group's pair around the shift c, its first folded reward ("pair"). When the
group's last member here has been served the pair is combined, g_G = scale·(G1' − mu·G2)
(the objective's closure), and the shared prompt is backpropagated once.

Group rewards reach a rank with the members served there, or — balanced routing, members
on several ranks — in the rollout's GroupRewards announcement.
"""

from __future__ import annotations

import time

import torch

from tsync_mcore.learner.accumulators import f32
from tsync_mcore.model.packed import Segment
from tsync_mcore.objectives.off_policy import behaviour_at, weighted_logp_sum
from tsync_mcore.platform import upload
from tsync_mcore.learner.prefix import SharedPrefix, prefix_len
from tsync_mcore.learner.schedule import Service
from tsync_mcore.learner.serving.view import UpdateView
from tsync_mcore.channel.sources import SourceError, TrajectorySource, check_reward, validate_source
from tsync_mcore.observability.trace import DeferredRecord


class TrajectoryKind:
    source_type = TrajectorySource
    name = "trajectory"  # what its trace records call a source
    announces_rewards = True  # GroupRewards carry what members on other ranks scored
    packs_pairs = True  # one group's members pack: one backward per distinct sum (≤ 2)

    def __init__(self, learner):
        self.up = UpdateView(learner)  # the update in progress, as far as a kind sees it

    def begin(self) -> None:
        self.rewards: dict[str, float] = {}  # every reward known here, served here or not
        # Segmented trajectories (TrajectorySource.n_segments > 1) seen here: their
        # segment count and scored total as their first segment said, the segments and
        # scored tokens arrived. A group is complete only once every segment of each of its
        # trajectories here has arrived (all of one trajectory's go to one rank).
        self.segmented: dict[str, tuple[int, int]] = {}
        self.whole: set[str] = set()  # trajectories that arrived as one sequence
        self.segments_seen: dict[str, int] = {}
        self.scored_seen: dict[str, int] = {}
        self.announced: set[str] = set()
        self.prefixes: dict[str, SharedPrefix | None] = {}
        self.closure: dict[str, tuple[float, float]] = {}  # (scale, mu) of combined pairs
        self.kv_peak_bytes = 0  # shared prompts' K/V + adjoints held at once

    # --- checks and completion ------------------------------------------------------------

    def validate(self, src: TrajectorySource) -> None:
        validate_source(src, self.up.policy.vocab_size, self.up.max_tokens)

    def check(self, src: TrajectorySource) -> None:
        t = src.traj_id
        known = self.rewards.get(t)
        if known is not None and known != float(src.reward):
            what = "its earlier segments came" if t in self.segmented else \
                "the group's rewards were announced"
            raise SourceError(f"trajectory {t!r}: reward {float(src.reward)!r}, but {what} "
                              f"with {known!r}")
        first = self.segmented.get(t)
        if (t in self.whole) != (src.n_segments == 1) and (first is not None or t in self.whole):
            was = "as one sequence" if t in self.whole else f"in {first[0]} segments"
            raise SourceError(f"trajectory {t!r}: arrived {was}, now as segment "
                              f"{src.segment} of {src.n_segments}")
        if first is None:
            return
        name = f"trajectory {t!r} segment {src.segment}"
        if (src.n_segments, src.scored_in_trajectory) != first:
            raise SourceError(f"{name}: says {src.n_segments} segments and "
                              f"{src.scored_in_trajectory} scored tokens, its first segment "
                              f"said {first[0]} and {first[1]}")
        scored = self.scored_seen[t] + src.n_scored
        last = self.segments_seen[t] + 1 == first[0]
        if scored > first[1] or (last and scored != first[1]):
            raise SourceError(f"{name}: its segments score {scored} tokens"
                              f"{'' if last else ' so far'}, trajectory_scored says {first[1]}")

    def arrived(self, src: TrajectorySource) -> None:
        t = src.traj_id
        self.rewards[t] = float(src.reward)
        if src.n_segments == 1:
            self.whole.add(t)
        else:
            self.segmented.setdefault(t, (src.n_segments, src.scored_in_trajectory))
            self.segments_seen[t] = self.segments_seen.get(t, 0) + 1
            self.scored_seen[t] = self.scored_seen.get(t, 0) + src.n_scored

    def unit_keys(self, traj_id: str) -> list[str]:
        n = self.segmented.get(traj_id, (1, 0))[0]
        return [traj_id] if n == 1 else [f"{traj_id}/{s}" for s in range(n)]

    def complete(self, g: str) -> bool:
        return all(t in self.rewards and self._segments_in(t) for t in self.up.plan.groups[g])

    def _segments_in(self, t: str) -> bool:
        """Every segment of trajectory t that this rank was given has arrived."""
        n = self.segmented.get(t, (1, 0))[0]
        return n == 1 or self.segments_seen[t] == n

    def announce(self, g: str, rewards: dict[str, float]) -> None:
        members = self.up.plan.groups.get(g)
        name = f"rewards of group {g!r}"
        if members is None:
            raise SourceError(f"{name}: group is not registered in this batch")
        if g in self.announced:
            raise SourceError(f"{name}: duplicate, already announced in this batch")
        if set(rewards) != set(members):
            raise SourceError(f"{name}: announced for {sorted(rewards)}, the group registered "
                              f"{sorted(members)}")
        for t, r in rewards.items():
            check_reward(f"{name}, member {t!r}", r)
            if t in self.rewards and self.rewards[t] != float(r):
                raise SourceError(f"{name}: {t!r} arrived with reward {self.rewards[t]!r}, "
                                  f"announced {float(r)!r}")
        self.announced.add(g)
        self.rewards.update({t: float(r) for t, r in rewards.items()})

    # --- admission ------------------------------------------------------------------------

    def opens(self, src: TrajectorySource) -> bool:
        """Serving it makes the group hold a pair, or a prompt shared with members to come."""
        q = self.up.queue
        return not q.is_complete(src.group_id) or (self.up.cfg.shared_prefix
                                                   and q.pending_in(src.group_id) > 1)

    def capped(self, src: TrajectorySource) -> bool:
        """Only a pair counts against k_open: a complete group's prompt K/V is
        activation-sized, and the pass it is served in bounds it."""
        return not self.up.queue.is_complete(src.group_id)

    def estimate(self, src: TrajectorySource) -> int:
        """Bytes the group will hold once open: its pair, and its prompt's K/V + adjoint."""
        q = self.up.queue
        n = 0 if q.is_complete(src.group_id) else 2 * self.up.acc.vector_bytes
        if self.up.cfg.shared_prefix:
            n += 2 * self.up.kv_per_token * prefix_len(src)
        return n

    def held_bytes(self) -> int:
        return sum(p.nbytes for p in self.prefixes.values() if p is not None)

    # --- service --------------------------------------------------------------------------

    def serve(self, svc: Service) -> dict:
        """One trajectory: backward, fold, and (its group finished) the pair's combine.

        With a KL or entropy term (R_i, objectives/regularizers.py) a direct fold puts the
        coefficient in the loss and backpropagates both at once; a pair fold backpropagates
        R_i on its own (a second cotangent over the same forward) into the group's G3."""
        src, g, up = svc.source, svc.group_id, self.up
        span = dict(span_tokens=0, context=0, logits=False)
        if src.n_scored > 0:
            up.flush_grads()  # its fold takes the buffers with its own coefficient
            acc = up.acc
            if svc.fold == "pair" and not acc.is_open(g):
                acc.open_group(g, shift=src.reward)  # c = the group's first folded reward
            # Token weight 1/L_i (or 1) now; the batch's divisor is the deferred scalar at
            # close (objectives/token_norm.py).
            w = up.norm.source_weight(src.scored_in_trajectory)
            aux_w = w * self._group_mean(g)  # R_i's coefficient, known at arrival
            # model.ep > 1: expert gradients land on the experts' ranks, summed with those of
            # the sources served there in the same pass, so the coefficient rides in the
            # loss and the fold adds the buffers as they are (only direct folds run then).
            # A regulariser on a direct fold rides in the same loss.
            coef_in_loss = svc.fold == "direct" and (up.policy.ep_size > 1 or up.reg.active)
            if coef_in_loss:
                w *= self._coef(src)
            prefix = self._prefix_for(src) if up.cfg.shared_prefix else None
            # ρ_t (off-policy correction) per scored token: inside the backward's weights.
            q = len(prefix) if prefix is not None else 0
            with up.routes.forward([(src.context, q, src.n_tokens - q)]):
                aux = self._backward(src, prefix, q, w, aux_w, svc.fold)
            span = dict(span_tokens=src.n_tokens - q, context=q, logits=True)
            grads = up.policy.grad_buffers()
            if svc.fold == "direct":
                coef = 1.0 if coef_in_loss else self._coef(src)
                up.fold_direct(g, grads, coef)
                if prefix is not None:
                    prefix.fold_direct(coef)
            else:
                acc.fold_pair(g, grads, src.reward)
                if prefix is not None:
                    prefix.fold_pair(src.reward - acc.shift_of(g))
                if aux is not None:
                    up.policy.zero_grads()
                    self._fold_aux(g, aux, prefix)
            up.policy.zero_grads()
        if svc.closes_group:
            self._combine(g)
        return span

    def _backward(self, src: TrajectorySource, prefix, q: int, w: float, aux_w: float,
                  fold: str) -> torch.Tensor | None:
        """The source's forward and backward of −w·Σ_t ρ_t log π (+ aux_w·R_i on a direct
        fold); returns R_i's loss, graph kept, when a pair fold must backpropagate it apart."""
        up = self.up
        reg = up.reg.active
        if prefix is None:
            out = up.policy.forward_source(list(src.tokens), list(src.scored_mask),
                                           with_entropy=reg)
        else:
            out = prefix.forward_continuation(up.policy, src, with_entropy=reg)
        logp, ent = out if reg else (out, None)
        rho = up.off_policy.weights(logp, behaviour_at(src.behaviour_logprobs,
                                                      src.scored_mask[q:], q))
        apart = None  # R_i's loss, when a pair fold backpropagates it on its own
        if not reg:  # exactly the path without regularisers
            loss = -w * weighted_logp_sum(logp, rho)
        else:
            loss = -f32(w) * weighted_logp_sum(logp, rho)
            aux = up.regularizer(src.tokens, src.scored_mask, q, logp, ent, aux_w)
            if fold == "direct":
                loss = loss + aux
            else:
                apart = aux
        loss.backward(retain_graph=apart is not None)  # kept for R_i's own backward
        return apart

    def _group_mean(self, g: str) -> float:
        """1/m_G when the token norm keeps the group mean (R_i's share of it), else 1."""
        return 1.0 / len(self.up.plan.groups[g]) if self.up.norm.group_mean else 1.0

    # --- packed serving (docs/design/learner.md) -------------------------------------------------

    def packable(self, src: TrajectorySource) -> bool:
        return src.n_scored > 0  # one without scored tokens runs nothing

    def pack_tokens(self, src: TrajectorySource) -> int:
        """Tokens it forwards: all of it, or what follows its group's shared prompt."""
        return src.n_tokens - (prefix_len(src) if self.up.cfg.shared_prefix else 0)

    def serve_pack(self, pack: list[Service]) -> list[dict]:
        """Trajectories in one forward, each against its group's prompt leaves when it has
        one (two members of a group share them; the leaves sum their adjoints as one-by-one
        folds would). Direct folds: one backward of Σ w_i·coef_i·loss_i, folded once into
        the batch. Pair folds (members of one incomplete group, queue.next_pack(pairs=True)):
        the group needs G1' += Σ (r_i − c)·H_i and G2 += Σ H_i, so one backward of
        Σ w_i·loss_i folded as one member with reward r when every member has the same r
        (binary rewards: most packs), else two backward cotangents over the one forward,
        Σ w_i·(r_i − c)·loss_i into G1' and Σ w_i·loss_i into G2."""
        up = self.up
        if up.cfg.shared_prefix:
            self._build_closing_prefixes(pack)
        segments, scored, spans, prefixes = [], [], [], {}
        for svc in pack:
            src = svc.source
            prefix = self._prefix_for(src) if up.cfg.shared_prefix else None
            q = len(prefix) if prefix is not None else 0
            if prefix is not None:
                prefixes[svc.group_id] = prefix
            ids = upload(src.tokens[q:], torch.long, up.policy.device)
            segments.append(Segment(ids, q, prefix.leaves if prefix is not None else None))
            scored.append([t for t, m in enumerate(src.scored_mask[q:]) if m])
            spans.append(dict(span_tokens=src.n_tokens - q, context=q, logits=True))
        pair = pack[0].fold == "pair"  # the queue packs pair folds of one group only
        with up.routes.forward([(svc.source.context, seg.offset, len(seg.tokens))
                               for svc, seg in zip(pack, segments)]):
            reg = up.reg.active
            out = up.policy.packed_logprobs(segments, scored, with_entropy=reg)
            logps, ents = out[0], (out[1] if reg else [None] * len(pack))
            terms = []  # (Σ_t ρ_t·log π(t), the member's token weight w_i)
            aux = None  # Σ_i R_i with their coefficients (KL / entropy terms)
            for svc, seg, logp, ent in zip(pack, segments, logps, ents):
                src = svc.source
                rho = up.off_policy.weights(logp, behaviour_at(src.behaviour_logprobs,
                                                              src.scored_mask[seg.offset:],
                                                              seg.offset))
                w = up.norm.source_weight(src.scored_in_trajectory)
                terms.append((weighted_logp_sum(logp, rho), w))
                if reg:
                    r = up.regularizer(src.tokens, src.scored_mask, seg.offset, logp, ent,
                                       w * self._group_mean(svc.group_id))
                    aux = r if aux is None else aux + r
            if not pair:
                loss = _loss(terms, [self._coef(svc.source) for svc in pack])
                (loss if aux is None else loss + aux).backward()
            else:
                self._pair_backward(pack, terms, prefixes, aux)
        if not pair:
            up.fold_later([svc.group_id for svc in pack])  # folded with what follows
            for prefix in prefixes.values():
                prefix.fold_direct(1.0)
        for svc in pack:
            if svc.closes_group:
                self._combine(svc.group_id)
        return spans

    def _pair_backward(self, pack: list[Service], terms: list, prefixes: dict,
                       aux: torch.Tensor | None = None) -> None:
        """The backward(s) of a pair pack and their folds into its group's sums; `aux`
        (Σ R_i), when given, last and on its own into G3 (and the prompt's A)."""
        g = pack[0].group_id
        self._pair_parts(pack, terms, prefixes, keep=aux is not None)
        if aux is not None:
            self._fold_aux(g, aux, prefixes.get(g))

    def _fold_aux(self, g: str, aux: torch.Tensor, prefix: SharedPrefix | None) -> None:
        """R_i (a pair pack's Σ R_i) alone, backpropagated into the group's G3 and its
        prompt's share into A; the grad buffers are clean before and after."""
        up = self.up
        aux.backward()
        up.acc.fold_aux(g, up.policy.grad_buffers())
        if prefix is not None:
            prefix.fold_direct(1.0)
        up.policy.zero_grads()

    def _pair_parts(self, pack: list[Service], terms: list, prefixes: dict,
                    keep: bool) -> None:
        """G1'/G2 of a pair pack; `keep`: the graph stays for one more backward."""
        up, g = self.up, pack[0].group_id
        up.flush_grads()  # the buffers go into the group's sums, not the batch
        if not up.acc.is_open(g):
            up.acc.open_group(g, shift=pack[0].source.reward)  # c = its first folded reward
        shift = up.acc.shift_of(g)
        prefix = prefixes.get(g)
        rewards = [float(svc.source.reward) for svc in pack]
        if len(set(rewards)) == 1:  # one cotangent: fold the sum as one member would be
            parts = [(None, [1.0] * len(pack))]
        else:
            parts = [("g1", [r - shift for r in rewards]), ("g2", [1.0] * len(pack))]
        for i, (part, coefs) in enumerate(parts):
            _loss(terms, coefs).backward(retain_graph=keep or i < len(parts) - 1)
            if part is None:
                up.acc.fold_pair(g, up.policy.grad_buffers(), rewards[0])
                if prefix is not None:
                    prefix.fold_pair(rewards[0] - shift)
            else:
                up.acc.fold_pair_part(g, up.policy.grad_buffers(), part)
                if prefix is not None:
                    prefix.fold_pair_part(part)
            up.policy.zero_grads()

    def after(self, svc: Service) -> None:
        pass  # a trajectory leaves no deferred work of its own

    def finish(self, svc: Service) -> None:
        """The group's last work here: combine its pair (if still open), then one backward
        through its shared prompt with scale·(A1 − mu·A2) + A (prompts forwarded in one
        packed pass: one backward when the last of them closes, recorded with its group)."""
        g = svc.group_id
        scale, mu = self.closure.pop(g) if g in self.closure else self._combine(g)
        prefix = self.prefixes.pop(g, None)
        start, cpu0 = self.up.now(), time.thread_time()
        ran = prefix.backward_prefix(scale, mu) if prefix is not None else []
        del prefix  # its K/V and graph are freed inside the timing
        if ran:
            self.up.fold_later(g)
            self.up.defer(DeferredRecord(
                update=self.up.version, rank=self.up.policy.par.rank, work="prefix", group_id=g,
                traj_id=None, ready=start, start=start, end=self.up.now(),
                cpu=time.thread_time() - cpu0, spans=[(n, 0) for n in ran]))

    def _combine(self, g: str) -> tuple[float, float]:
        """Add the group's pair into the batch; returns (scale, mu) for its prompt."""
        scale, mu = 1.0, 0.0
        if self.up.acc.is_open(g):
            scale, mu = self.up.objective.closure(self._group_rewards(g),
                                                 self.up.acc.shift_of(g), self.up.cfg.adv_eps,
                                                 self.up.adv_ddof, self.up.norm.group_mean)
            self.up.acc.close_group(g, scale, mu)  # in the batch now (acc.committed)
        self.closure[g] = (scale, mu)
        return scale, mu

    def drop(self, g: str) -> None:
        prefix = self.prefixes.pop(g, None)
        if prefix is not None:
            prefix.release()
        self.closure.pop(g, None)

    def advantage(self, src: TrajectorySource) -> float:
        """A_i of a source whose group's rewards are all known (PPO mini-batches 2..m)."""
        i = self.up.plan.groups[src.group_id].index(src.traj_id)
        return self.up.objective.advantages(self._group_rewards(src.group_id),
                                            self.up.cfg.adv_eps, self.up.adv_ddof)[i]

    def _coef(self, src: TrajectorySource) -> float:
        i = self.up.plan.groups[src.group_id].index(src.traj_id)
        return self.up.objective.source_coef(self._group_rewards(src.group_id), i,
                                            self.up.cfg.adv_eps, self.up.adv_ddof,
                                            self.up.norm.group_mean)

    def _group_rewards(self, g: str) -> list[float]:
        return [self.rewards[t] for t in self.up.plan.groups[g]]

    def _build_closing_prefixes(self, pack: list[Service]) -> None:
        """The prompts of the groups this pass closes, not forwarded yet: one packed forward
        (their backwards then run as one when the last of them closes, right after the
        pass). A group that stays open past the pass builds its own when first served."""
        closing = {svc.group_id for svc in pack if svc.last_here}
        first: dict[str, TrajectorySource] = {}
        for svc in pack:
            g = svc.group_id
            if g in closing and g not in self.prefixes and g not in first:
                first[g] = svc.source
        if len(first) < 2:
            return
        srcs = list(first.values())
        with self.up.routes.forward([(s.context, 0, prefix_len(s)) for s in srcs]):
            built = SharedPrefix.build_many(self.up.policy, srcs, dtype=self.up.acc.dtype)
        for (g, src), prefix in zip(first.items(), built):
            self._keep_prefix(g, src, prefix)

    def _keep_prefix(self, g: str, src: TrajectorySource, prefix: SharedPrefix | None) -> None:
        self.prefixes[g] = prefix
        if prefix is not None:
            prefix.owner = src.context
            self.up.saw_kv(prefix.produced, len(prefix))
            self.kv_peak_bytes = max(self.kv_peak_bytes, self.held_bytes())

    def _prefix_for(self, src: TrajectorySource) -> SharedPrefix | None:
        """The group's shared prompt, computed once on its first scored source."""
        g = src.group_id
        if g not in self.prefixes:
            with self.up.routes.forward([(src.context, 0, prefix_len(src))]):
                self._keep_prefix(g, src, SharedPrefix.build(self.up.policy, src,
                                                             dtype=self.up.acc.dtype))
        prefix = self.prefixes[g]
        # a member whose prompt was routed to other experts runs it with its own
        return prefix if prefix is not None and prefix.covers(src) and self.up.routes.agree(
            prefix.owner, src.context, len(prefix)) else None


def _loss(terms: list[tuple[torch.Tensor, float]], coefs: list[float]) -> torch.Tensor:
    """−Σ_i f32(w_i·coef_i)·Σ_t ρ_t·log π(t): a pass's loss for one set of coefficients."""
    loss = 0.0
    for (logp_sum, w), coef in zip(terms, coefs):
        loss = loss - f32(w * coef) * logp_sum
    return loss
