"""Serving OPD sources: turns, each run against its trajectory's earlier K/V.

A turn's forward runs against the K/V of its trajectory's earlier turns (and its group's
shared prompt), held as detached leaves; its backward gives the turn's own parameter
gradient and adjoints on that context, accumulated on the leaves' .grad. A turn that
starts with a scored token starts its span one position earlier: that position's logits
score it, computed against the context before it (the same function of θ and the earlier
K/V as in the previous turn, so the chain rule stays exact).

Deferred work: when a trajectory's last turn is served, the earlier turns are replayed in
reverse order — each recomputed from its own context leaves (or kept, `opd_replay:
retain`) and backpropagated with the adjoint of the K/V it produced, which adds to the
adjoints of the turns before it. After the group's last trajectory here, one backward
through its shared prompt with the members' summed adjoints.

Folds: into the batch once the group is complete (every turn of every member arrived:
nothing of it can be rejected any more), before that into the group's own gradient sum,
which a dropped group discards and a finished group adds to the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tsync_mcore.model.packed import Segment
from tsync_mcore.model.span import (KV, backward_kv, concat_kv, detached_leaves, kv_bytes,
                                    leaf_adjoints)
from tsync_mcore.objectives.off_policy import behaviour_at, scored_positions
from tsync_mcore.platform import upload
from tsync_mcore.learner.prefix import SharedPrefix, prefix_len
from tsync_mcore.learner.schedule import Service
from tsync_mcore.learner.serving.view import UpdateView
from tsync_mcore.channel.sources import SourceError, TurnSource, validate_turn
from tsync_mcore.observability.trace import DeferredRecord


@dataclass
class _Context:
    """A trajectory's served turns: their K/V as leaves (whose .grad is the adjoint)."""

    prompt: SharedPrefix | None = None  # the group's shared prompt, when this one starts with it
    # This trajectory's own leaves over the prompt K/V (same storage): its adjoint stays
    # separate, so the group sums per-trajectory adjoints in the accumulator precision.
    prompt_leaves: list[KV] | None = None
    turns: list[TurnSource] = field(default_factory=list)
    leaves: list[list[KV]] = field(default_factory=list)
    kept: list[list[KV]] = field(default_factory=list)  # graph-attached K/V, retain mode only
    nbytes: int = 0  # leaves plus their adjoints (same shape) once a later turn consumed them

    def span(self, turn: TurnSource) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(start, tokens, scored mask) this learner computes for a turn: turn 0 skips the
        shared prompt, whose K/V come from the group's prefix leaves; a turn that starts
        with a scored token starts one position earlier (the previous turn's last token)."""
        if turn.turn == 0:
            q = len(self.prompt) if self.prompt is not None else 0
            return turn.start + q, turn.tokens[q:], turn.scored_mask[q:]
        if turn.scored_mask[0]:
            prev = self.turns[turn.turn - 1].tokens[-1]
            return turn.start - 1, (prev, *turn.tokens), (0, *turn.scored_mask)
        return turn.start, turn.tokens, turn.scored_mask

    def past(self, i: int, offset: int) -> list[KV] | None:
        """Context K/V leaves of turn i's span (`offset` positions): the shared prompt,
        then turns 0..i−1, cut to the span's start."""
        parts = ([self.prompt_leaves] if self.prompt is not None else []) + self.leaves[:i]
        if not parts:
            return None
        kv = concat_kv(parts)
        n = len(kv[0])
        return kv if n == offset else [KV(x.k[:offset], x.v[:offset]) for x in kv]

    def add_leaves(self, kv: list[KV]) -> int:
        """Keep a served turn's K/V as leaves; returns the bytes this adds (× 2: adjoints)."""
        self.leaves.append(detached_leaves(kv))
        added = 2 * kv_bytes(kv)
        self.nbytes += added
        return added


class TurnKind:
    source_type = TurnSource
    name = "turn"  # what its trace records call a source
    packs_pairs = True  # a pair fold is the group's plain sum: one group's turns pack too
    announces_rewards = False  # no group statistics: a turn's coefficient is its own

    def __init__(self, learner):
        self.up = UpdateView(learner)  # the update in progress, as far as a kind sees it

    def begin(self) -> None:
        plan = self.up.plan
        self.n_turns = plan.n_turns
        missing = [t for ts in plan.groups.values() for t in ts if t not in self.n_turns]
        if missing:
            raise SourceError(f"turn sources need every trajectory's turn count; none "
                              f"registered for {missing[:5]}")
        self.units = {g: sum(self.n_turns[t] for t in ts) for g, ts in plan.groups.items()}
        self.arrived_units: dict[str, int] = {}
        self.ctx: dict[str, _Context] = {}
        self.prompts: dict[str, SharedPrefix | None] = {}
        self.kv_group: dict[str, int] = {}  # context leaves + adjoints and prompts held now
        self.kv_peak_bytes = 0
        self.kept_tokens: dict[str, int] = {}  # arrived tokens whose K/V a group will keep

    # --- checks and completion ------------------------------------------------------------

    def validate(self, turn: TurnSource) -> None:
        validate_turn(turn, self.up.policy.vocab_size, self.up.max_tokens)

    def check(self, turn: TurnSource) -> None:
        name = f"turn {turn.turn} of trajectory {turn.traj_id!r}"
        n = self.n_turns[turn.traj_id]
        if turn.n_turns != n or not 0 <= turn.turn < n:
            raise SourceError(f"{name}: trajectory registered with {n} turns, turn says "
                              f"{turn.turn} of {turn.n_turns}")
        arrived = self.up.arrived
        prev = arrived.get(f"{turn.traj_id}#{turn.turn - 1}")
        nxt = arrived.get(f"{turn.traj_id}#{turn.turn + 1}")
        if turn.turn == 0 and turn.start != 0:
            raise SourceError(f"{name}: the first turn must start at token 0, not {turn.start}")
        if prev is not None and prev.end != turn.start:
            raise SourceError(f"{name}: starts at token {turn.start} but turn {prev.turn} "
                              f"ends at {prev.end}; turn spans must be contiguous")
        if nxt is not None and turn.end != nxt.start:
            raise SourceError(f"{name}: ends at token {turn.end} but turn {nxt.turn} starts "
                              f"at {nxt.start}; turn spans must be contiguous")

    def arrived(self, turn: TurnSource) -> None:
        g = turn.group_id
        self.arrived_units[g] = self.arrived_units.get(g, 0) + 1
        if turn.turn < turn.n_turns - 1:  # a trajectory's last turn keeps no K/V
            self.kept_tokens[g] = self.kept_tokens.get(g, 0) + len(turn.tokens)

    def unit_keys(self, traj_id: str) -> list[str]:
        return [f"{traj_id}#{j}" for j in range(self.n_turns[traj_id])]

    def complete(self, g: str) -> bool:
        return self.arrived_units.get(g, 0) == self.units[g]

    def announce(self, g: str, rewards: dict[str, float]) -> None:
        raise SourceError(f"rewards of group {g!r}: the {self.up.cfg.objective} objective has no "
                          f"group rewards to announce")

    # --- admission ------------------------------------------------------------------------

    def opens(self, turn: TurnSource) -> bool:
        return True  # a context, and until the group is complete its gradient sum

    def capped(self, turn: TurnSource) -> bool:
        return True  # its trajectories' contexts live across passes, turn after turn

    def estimate(self, turn: TurnSource) -> int:
        """Bytes the group will hold at most, counting its turns that have arrived: every
        kept turn's K/V + adjoint, and its gradient sum while incomplete."""
        g = turn.group_id
        n = 2 * self.up.kv_per_token * self.kept_tokens.get(g, 0)
        return n if self.up.queue.is_complete(g) else n + self.up.acc.vector_bytes

    def held_bytes(self) -> int:
        return sum(self.kv_group.values())

    # --- service --------------------------------------------------------------------------

    def serve(self, svc: Service) -> dict:
        turn = svc.source
        n_tokens, offset = self._run_turn(turn, svc)  # its tensors are freed by now: timed too
        return dict(span_tokens=n_tokens, context=offset, logits=turn.n_scored > 0)

    # --- packed serving (docs/design/learner.md) -------------------------------------------------

    def packable(self, turn: TurnSource) -> bool:
        """A scored turn under recompute replay. Unscored turns run to their K/V only, and a
        retained graph of a packed pass would be replayed whole for each of its turns."""
        return turn.n_scored > 0 and self.up.cfg.opd_replay == "recompute"

    def pack_tokens(self, turn: TurnSource) -> int:
        return len(turn.tokens) + (1 if turn.turn > 0 and turn.scored_mask[0] else 0)

    def serve_pack(self, pack: list[Service]) -> list[dict]:
        """Turns of different trajectories (the queue never packs two of one: a turn runs
        on its predecessor's K/V) in one forward/backward, each against its own context;
        the summed turn losses' gradient is folded once (into the batch, or into the one
        group's sum while it can still be dropped), and each keeps its K/V as leaves."""
        up = self.up
        segments, scored, turns = [], [], []
        for svc in pack:
            turn = svc.source
            if turn.turn == 0:
                prompt = self._prompt_for(turn)
                self.ctx[turn.traj_id] = _Context(
                    prompt=prompt,
                    prompt_leaves=detached_leaves(prompt.produced) if prompt else None)
            ctx = self.ctx[turn.traj_id]
            offset, tokens, mask = ctx.span(turn)
            ids = upload(tokens, torch.long, up.policy.device)
            segments.append(Segment(ids, offset, ctx.past(turn.turn, offset)))
            scored.append([p for p, m in enumerate(mask) if m])
            turns.append((turn, ctx, offset, mask))
        with up.routes.forward([(turn.traj_id, offset, len(seg.tokens))
                               for (turn, _, offset, _), seg in zip(turns, segments)]):
            reg = up.reg.active
            out = up.policy.packed_logprobs(segments, scored, with_entropy=reg)
            logps, kvs = out[0], out[-1]
            ents = out[1] if reg else [None] * len(pack)
            loss = 0.0
            for (turn, _, offset, mask), at, student, ent in zip(turns, scored, logps, ents):
                term, bonus = self._loss(turn, mask, offset - turn.start, at, student, ent)
                loss = loss + term
                if bonus is not None:
                    loss = loss + bonus
            loss.backward()
        if pack[0].fold == "pair":  # the queue packs pair folds of one group only
            self._fold(pack[0].group_id, "pair")
        else:
            up.fold_direct([svc.group_id for svc in pack], up.policy.grad_buffers(), 1.0)
            up.policy.zero_grads()
        spans = []
        for (turn, ctx, offset, _), seg, kv in zip(turns, segments, kvs):
            kv = self._own(kv, offset, turn)
            up.saw_kv(kv, len(kv[0]))
            ctx.turns.append(turn)
            if turn.turn < turn.n_turns - 1:
                # own storage: a view would keep the whole pass's K/V alive with it
                own = [KV(x.k.detach().clone(), x.v.detach().clone()) for x in kv]
                self._hold(turn.group_id, ctx.add_leaves(own))
            spans.append(dict(span_tokens=len(seg.tokens), context=offset, logits=True))
        return spans

    def after(self, svc: Service) -> None:
        """Deferred work of a trajectory's last turn: its context replay."""
        turn = svc.source
        if turn is not None and turn.turn == turn.n_turns - 1:
            self._replay(turn.traj_id, svc)

    def finish(self, svc: Service) -> None:
        """After the group's last trajectory here: its prompt's backward, then its sum."""
        g = svc.group_id
        prompt = self.prompts.pop(g, None)
        if prompt is not None:
            self._free(g, prompt.nbytes)
        start, cpu0 = self.up.now(), time.thread_time()
        ran = prompt is not None and prompt.backward_prefix(1.0, 0.0)
        n = len(prompt) if prompt is not None else 0
        del prompt  # its K/V and graph are freed inside the timing
        if ran:
            self._fold(g, "direct")  # the group is complete by now
            self.up.defer(DeferredRecord(
                update=self.up.version, rank=self.up.policy.par.rank, work="prefix", group_id=g,
                traj_id=None, ready=start, start=start, end=self.up.now(),
                cpu=time.thread_time() - cpu0, spans=[(n, 0)]))
        if self.up.acc.is_open(g):
            self.up.acc.close_group(g, 1.0, -1.0)  # batch += its gradient sum

    def drop(self, g: str) -> None:
        for t in [t for t, c in self.ctx.items() if self.up.member_of[t] == g]:
            del self.ctx[t]
        self.prompts.pop(g, None)
        self.kv_group.pop(g, None)

    # --- one turn -------------------------------------------------------------------------

    def _run_turn(self, turn: TurnSource, svc: Service) -> tuple[int, int]:
        """Forward the turn on its context, backward its loss, keep its K/V; returns the
        (tokens, context) that ran, for the FLOP ledger."""
        up = self.up
        if turn.turn == 0:
            prompt = self._prompt_for(turn)
            self.ctx[turn.traj_id] = _Context(
                prompt=prompt, prompt_leaves=detached_leaves(prompt.produced) if prompt else None)
        ctx = self.ctx[turn.traj_id]
        last = turn.turn == turn.n_turns - 1
        dev = up.policy.device
        offset, tokens, mask = ctx.span(turn)
        ids = upload(tokens, torch.long, dev)
        with up.routes.forward([(turn.traj_id, offset, len(tokens))]):
            logits, kv = up.policy.span_forward(ids, offset, ctx.past(turn.turn, offset),
                                               want_logits=turn.n_scored > 0)
            kv = self._own(kv, offset, turn)
            up.saw_kv(kv, len(kv[0]))
            if turn.n_scored > 0:
                at = scored_positions(mask)  # on the host: no device read per turn
                pos = upload(at, torch.long, dev)
                student, ent = up.policy.scored_logprob(logits, ids, pos, with_entropy=True)
                loss, bonus = self._loss(turn, mask, offset - turn.start, at, student, ent)
                if bonus is not None:
                    loss = loss + bonus
                loss.backward(retain_graph=up.cfg.opd_replay == "retain" and not last)
        if turn.n_scored > 0:
            self._fold(turn.group_id, svc.fold)
        ctx.turns.append(turn)
        if not last:
            self._hold(turn.group_id, ctx.add_leaves(kv))
            if up.cfg.opd_replay == "retain":
                ctx.kept.append(kv)
        return len(tokens), offset

    def _loss(self, turn: TurnSource, mask, q: int, at: list[int], student: torch.Tensor,
              ent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A turn's loss over its scored positions `at` of its span (`q` positions before
        the turn's start): the objective's per-token term (N_k is the deferred scalar), and
        the entropy bonus when it is on (weight 1: token_mean's 1/N_k at close). ρ_t comes
        from this forward's own log π_θ: replay never re-scores a token (it pushes K/V
        adjoints back only), so the weight is fixed here, once."""
        up = self.up
        teacher = upload([turn.teacher_logprobs[q + p] for p in at], torch.float64,
                         up.policy.device)
        rho = up.off_policy.weights(student, behaviour_at(turn.behaviour_logprobs, mask, q))
        term = up.objective.turn_loss(student, teacher, rho)
        if not up.reg.active:
            return term, None
        return term, up.regularizer(None, mask, 0, student, ent, 1.0)

    @staticmethod
    def _own(kv: list[KV], offset: int, turn: TurnSource) -> list[KV]:
        """The K/V of the turn's own positions (a span that started one earlier drops it)."""
        skip = turn.start - offset if turn.turn > 0 else 0
        return kv if skip == 0 else [KV(x.k[skip:], x.v[skip:]) for x in kv]

    def _replay(self, traj_id: str, svc: Service) -> None:
        """Deferred work: push accumulated K/V adjoints back through earlier turns."""
        up = self.up
        start, cpu0 = up.now(), time.thread_time()
        ctx = self.ctx.pop(traj_id)
        g = self.up.member_of[traj_id]
        self._free(g, ctx.nbytes)
        spans = []  # (tokens, context) of every turn pushed back through (FLOP ledger)
        for i in reversed(range(len(ctx.leaves))):
            adjoint = leaf_adjoints(ctx.leaves[i])
            if all(gk is None and gv is None for gk, gv in adjoint):
                continue  # no later turn had a scored token
            turn = ctx.turns[i]
            offset_i, tokens_i, _ = ctx.span(turn)
            spans.append((len(tokens_i), offset_i))
            if up.cfg.opd_replay == "retain":
                produced = ctx.kept[i]
            else:
                ids = upload(tokens_i, torch.long, up.policy.device)
                with up.routes.forward([(traj_id, offset_i, len(tokens_i))]):
                    _, produced = up.policy.span_forward(ids, offset_i, ctx.past(i, offset_i),
                                                        stop_after_kv=True)
                produced = self._own(produced, offset_i, turn)
            backward_kv(produced, adjoint)
        self._fold(g, svc.fold)
        if ctx.prompt is not None:
            ctx.prompt.fold_direct(1.0, ctx.prompt_leaves)
        del ctx  # the context is freed inside the timing
        up.defer(DeferredRecord(
            update=up.version, rank=up.policy.par.rank, work="replay", group_id=g,
            traj_id=traj_id, ready=start, start=start, end=up.now(),
            cpu=time.thread_time() - cpu0, spans=spans, replay_mode=up.cfg.opd_replay))

    def _prompt_for(self, turn: TurnSource) -> SharedPrefix | None:
        """The group's shared prompt (built from its first served turn 0), if this turn
        starts with it. Members' prompt adjoints are summed and pushed back once."""
        if not self.up.cfg.shared_prefix:
            return None
        g = turn.group_id
        if g not in self.prompts:
            with self.up.routes.forward([(turn.traj_id, 0, prefix_len(turn))]):
                self.prompts[g] = SharedPrefix.build(self.up.policy, turn, dtype=self.up.acc.dtype)
            if self.prompts[g] is not None:
                self.prompts[g].owner = turn.traj_id
                self._hold(g, self.prompts[g].nbytes)
        prompt = self.prompts[g]
        # a member whose prompt was routed to other experts runs it with its own
        return prompt if prompt is not None and prompt.covers(turn) and self.up.routes.agree(
            prompt.owner, turn.traj_id, len(prompt)) else None

    def _fold(self, g: str, fold: str) -> None:
        """The turn's (or replay's) gradient out of the grad buffers: into the batch, or the
        group's own sum while the group can still be dropped."""
        up = self.up
        grads = up.policy.grad_buffers()
        if fold == "direct":
            up.fold_direct(g, grads, 1.0)
        else:
            if not up.acc.is_open(g):
                up.acc.open_group(g, shift=0.0)
            up.acc.fold_pair(g, grads, 0.0)  # r − c = 0: G2 alone, the plain sum
        up.policy.zero_grads()

    def _hold(self, g: str, n: int) -> None:
        self.kv_group[g] = self.kv_group.get(g, 0) + n
        self.kv_peak_bytes = max(self.kv_peak_bytes, self.held_bytes())

    def _free(self, g: str, n: int) -> None:
        left = self.kv_group.get(g, 0) - n
        if left:
            self.kv_group[g] = left
        else:
            self.kv_group.pop(g, None)  # the group holds nothing more
