"""One OPD update with per-turn gradient streaming and deferred context replay (SPEC §2).

    begin(plan, n_turns)  register trajectories (grouped) and their turn counts
    submit(turn)          validate → release per schedule → serve: the turn's forward runs
                          against its trajectory's earlier K/V, held as detached leaves;
                          backward gives the turn's own parameter gradient (folded into
                          the batch accumulator at once) and adjoints on the context K/V
                          (accumulated on the leaves' .grad)
    trajectory complete   deferred replay: earlier turns in reverse order, each recomputed
                          from its own context leaves (or kept, `opd_replay: retain`) and
                          backpropagated with the adjoint of the K/V it produced, which adds
                          to the adjoints of the turns before it — exact chain rule
    serve_next()          with submit(..., serve=False): serve one turn at a time, the
                          caller handing over every arrival it holds in between
    close()               every turn present → N_k all-reduced → 1/N_k → one optimizer step

A turn is served only after the previous turn of its trajectory (it needs that K/V); a turn
that arrives early is held, not rejected. Nothing touches θ before close().
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tsync_mcore.accumulators import GradAccumulators
from tsync_mcore.config import LearnerConfig
from tsync_mcore.learner import ACCUM_DTYPES, UpdateResult
from tsync_mcore.model.span import (KV, backward_kv, concat_kv, detached_leaves, kv_bytes,
                                    leaf_adjoints)
from tsync_mcore.objectives.opd import turn_loss
from tsync_mcore.policy import Policy
from tsync_mcore.prefix import SharedPrefix
from tsync_mcore.schedule import SCHEDULES
from tsync_mcore.sources import (BatchPlan, SourceError, TurnSource, assign_groups,
                                 check_version, validate_turn)
from tsync_mcore.trace import DeferredRecord, Record, SourceRecord, UpdateRecord


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

    def span(self, turn: TurnSource) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(start, tokens, scored mask) this learner computes for a turn: turn 0 skips the
        shared prompt, whose K/V come from the group's prefix leaves."""
        q = len(self.prompt) if self.prompt is not None and turn.turn == 0 else 0
        return turn.start + q, turn.tokens[q:], turn.scored_mask[q:]

    def past(self, i: int) -> list[KV] | None:
        """Context K/V leaves of turn i: the shared prompt, then turns 0..i−1."""
        parts = ([self.prompt_leaves] if self.prompt is not None else []) + self.leaves[:i]
        return concat_kv(parts) if parts else None

    nbytes: int = 0  # leaves plus their adjoints (same shape) once a later turn consumed them

    def add_leaves(self, kv: list[KV]) -> int:
        """Keep a served turn's K/V as leaves; returns the bytes this adds (× 2: adjoints)."""
        self.leaves.append(detached_leaves(kv))
        added = 2 * kv_bytes(kv)
        self.nbytes += added
        return added


class OPDLearner:
    def __init__(self, cfg: LearnerConfig, policy: Policy, policy_version: int = 0,
                 replay_mode: str = "recompute"):
        if replay_mode not in ("recompute", "retain"):
            raise ValueError(f"opd replay mode must be 'recompute' or 'retain', got {replay_mode!r}")
        self.cfg = cfg
        self.policy = policy
        self.version = policy_version
        self.replay_mode = replay_mode
        self.acc = GradAccumulators(policy.grad_buffers(), cfg.k_open, cfg.accum,
                                    dtype=ACCUM_DTYPES[cfg.accum_dtype])
        self.plan: BatchPlan | None = None

    # --- register -------------------------------------------------------------------------

    def begin(self, plan: BatchPlan, n_turns: dict[str, int],
              group_tokens: dict[str, int] | None = None, schedule: str | None = None,
              t0: float | None = None) -> None:
        """`schedule` overrides the configured release schedule for this batch only; `t0`
        (perf_counter, default now) is the origin of the trace's times."""
        if self.plan is not None:
            raise RuntimeError(f"batch for policy version {self.version} is still open")
        schedule = schedule or self.cfg.schedule
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}")
        self.schedule = schedule
        par = self.policy.par
        owner = assign_groups(plan, group_tokens or {}, par.dp_size)
        self.plan = plan
        self.n_turns = dict(n_turns)
        self.group_of = {t: g for g, ts in plan.groups.items() for t in ts}
        self.mine = {t for t, g in self.group_of.items() if owner[g] == par.dp_rank}
        self.arrived: dict[str, TurnSource] = {}
        self.released: dict[str, TurnSource] = {}  # by turn key, in release order
        self.held: list[TurnSource] = []
        # Servable released turns, in release order (ordered sets): those continuing a
        # started trajectory (previous turn served) come before those starting one (turn 0).
        self.continuing: dict[str, None] = {}
        self.starting: dict[str, None] = {}
        self.ctx: dict[str, _Context] = {}
        self._last_traj: str | None = None
        self.prompts: dict[str, SharedPrefix | None] = {}
        self.open_members = {g: sum(t in self.mine for t in ts) for g, ts in plan.groups.items()}
        self.trace: list[Record] = []
        self.scored_local = 0
        self.kv_peak_bytes = 0
        self.kv_live_bytes = 0  # context leaves + adjoints and shared prompts held now
        self.t0 = time.perf_counter() if t0 is None else t0
        self.acc.reset()

    # --- stream ---------------------------------------------------------------------------

    def submit(self, turn: TurnSource, arrived: float | None = None, serve: bool = True) -> None:
        """Accept a scored turn and serve what is servable now (`serve=False`: leave that to
        `serve_next`, so a caller holding more arrivals hands them all over first).
        `arrived`: perf_counter time the turn reached this process (default: now)."""
        self._check(turn)
        self.arrived[turn.key] = turn
        if turn.traj_id not in self.mine:
            return
        self.trace.append(SourceRecord(
            update=self.version, rank=self.policy.par.rank, source="turn",
            traj_id=turn.traj_id, group_id=turn.group_id, turn=turn.turn,
            policy_version=turn.policy_version, scored_tokens=turn.n_scored,
            ready=self._now() if arrived is None else arrived - self.t0, fold="direct"))
        sched = self.schedule
        if sched == "thundersync":
            self._release([turn])
        else:
            self.held.append(turn)
            if sched == "group_ready" and self._all_turns_arrived(turn.traj_id):
                # Per trajectory: its turns are released when its last turn is scored.
                self._release([t for t in self.held if t.traj_id == turn.traj_id])
                self.held = [t for t in self.held if t.traj_id != turn.traj_id]
        if serve:
            self._drain()

    def _release(self, turns: list[TurnSource]) -> None:
        for t in turns:
            self.released[t.key] = t
            ctx = self.ctx.get(t.traj_id)
            if t.turn == 0:
                self.starting[t.key] = None
            elif ctx is not None and len(ctx.turns) == t.turn:  # else: when t.turn-1 is served
                self.continuing[t.key] = None

    def _all_turns_arrived(self, traj_id: str) -> bool:
        return all(f"{traj_id}#{j}" in self.arrived for j in range(self.n_turns[traj_id]))

    def _check(self, turn: TurnSource) -> None:
        if self.plan is None:
            raise RuntimeError("submit() before begin(): no batch is open")
        validate_turn(turn, self.policy.vocab_size)
        name = f"turn {turn.turn} of trajectory {turn.traj_id!r}"
        check_version(name, turn.policy_version, self.version)
        if self.group_of.get(turn.traj_id) != turn.group_id:
            raise SourceError(f"{name}: trajectory not registered in group {turn.group_id!r}")
        if turn.key in self.arrived:
            raise SourceError(f"{name}: duplicate, already received in this batch")
        n = self.n_turns[turn.traj_id]
        if turn.n_turns != n or not 0 <= turn.turn < n:
            raise SourceError(f"{name}: trajectory registered with {n} turns, turn says "
                              f"{turn.turn} of {turn.n_turns}")
        prev = self.arrived.get(f"{turn.traj_id}#{turn.turn - 1}")
        nxt = self.arrived.get(f"{turn.traj_id}#{turn.turn + 1}")
        if turn.turn == 0 and turn.start != 0:
            raise SourceError(f"{name}: the first turn must start at token 0, not {turn.start}")
        if prev is not None and prev.end != turn.start:
            raise SourceError(f"{name}: starts at token {turn.start} but turn {prev.turn} "
                              f"ends at {prev.end}; turn spans must be contiguous")
        if nxt is not None and turn.end != nxt.start:
            raise SourceError(f"{name}: ends at token {turn.end} but turn {nxt.turn} starts "
                              f"at {nxt.start}; turn spans must be contiguous")

    def serve_next(self) -> bool:
        """Serve the next servable released turn; False when there is none now."""
        key = self._next_servable()
        if key is None:
            return False
        self.continuing.pop(key, None)
        self.starting.pop(key, None)
        self._serve(self.released.pop(key))
        return True

    def _drain(self) -> None:
        while self.serve_next():
            pass

    def _next_servable(self) -> str | None:
        """Key of the released turn to serve next: one whose earlier turns are served.
        Preferred: the next turn of the trajectory served last (its K/V context is still in
        cache), then a turn continuing a started trajectory (earliest released), and only
        then the earliest released turn 0, which starts one. A learner behind the
        rollout so keeps few trajectories open: their context K/V and adjoints are held
        until their replay (CPU overlap benchmark, B = 128, at a turn's service: 29 open on
        average in readiness order, 1.0 this way at r = 0.5 and 3.5–4.1 at r = 1), and a
        turn's context is warm when it runs.
        The lane finishes at the same time in any work-conserving order; only the cost per
        turn and the memory held differ. Lookups, not scans: a learner behind the rollout
        holds hundreds of turns."""
        last = self._last_traj
        if last is not None and last in self.ctx:
            key = f"{last}#{len(self.ctx[last].turns)}"
            if key in self.released:
                return key
        for servable in (self.continuing, self.starting):
            if servable:
                return next(iter(servable))
        return None

    def _serve(self, turn: TurnSource) -> None:
        self._last_traj = turn.traj_id
        start = self._now()
        cpu0 = time.thread_time()
        n_tokens, offset = self._run_turn(turn)  # its tensors are freed by now: timed too
        self._note(turn, start=start, end=self._now(), cpu=time.thread_time() - cpu0,
                   span_tokens=n_tokens, context=offset, logits=turn.n_scored > 0)
        if turn.turn == turn.n_turns - 1:
            self._replay(turn.traj_id)

    def _run_turn(self, turn: TurnSource) -> tuple[int, int]:
        """Forward the turn on its context, backward its loss, keep its K/V; returns the
        (tokens, context) that ran, for the FLOP ledger."""
        if turn.turn == 0:
            prompt = self._prompt_for(turn)
            self.ctx[turn.traj_id] = _Context(
                prompt=prompt, prompt_leaves=detached_leaves(prompt.produced) if prompt else None)
        ctx = self.ctx[turn.traj_id]
        last = turn.turn == turn.n_turns - 1
        dev = self.policy.device
        offset, tokens, mask = ctx.span(turn)
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        logits, kv = self.policy.span_forward(ids, offset, ctx.past(turn.turn),
                                              want_logits=turn.n_scored > 0)
        if turn.n_scored > 0:
            pos = torch.nonzero(torch.tensor(mask, device=dev)).squeeze(1)
            q = offset - turn.start
            teacher = torch.tensor([turn.teacher_logprobs[q + p] for p in pos.tolist()],
                                   dtype=torch.float64, device=dev)
            student = self.policy.scored_logprob(logits, ids, pos)
            loss = turn_loss(student, teacher)  # N_k is the deferred scalar at close
            loss.backward(retain_graph=self.replay_mode == "retain" and not last)
            self._fold()
            self.scored_local += turn.n_scored
        ctx.turns.append(turn)
        if not last:
            if (nxt := f"{turn.traj_id}#{turn.turn + 1}") in self.released:
                self.continuing[nxt] = None
            self.kv_live_bytes += ctx.add_leaves(kv)
            if self.replay_mode == "retain":
                ctx.kept.append(kv)
        self.kv_peak_bytes = max(self.kv_peak_bytes, self.kv_live_bytes)
        return len(tokens), offset

    def _replay(self, traj_id: str) -> None:
        """Deferred work: push accumulated K/V adjoints back through earlier turns."""
        start, cpu0 = self._now(), time.thread_time()
        spans = self._push_back(self.ctx.pop(traj_id))  # context freed: timed too
        self.trace.append(DeferredRecord(
            update=self.version, rank=self.policy.par.rank, work="replay",
            group_id=self.group_of[traj_id], traj_id=traj_id, ready=start, start=start,
            end=self._now(), cpu=time.thread_time() - cpu0, spans=spans,
            replay_mode=self.replay_mode))
        self._prompt_done(self.group_of[traj_id])  # its own trace entry, after this one

    def _push_back(self, ctx: _Context) -> list[tuple[int, int]]:
        self.kv_live_bytes -= ctx.nbytes
        spans = []  # (tokens, context) of every turn pushed back through (FLOP ledger)
        for i in reversed(range(len(ctx.leaves))):
            adjoint = leaf_adjoints(ctx.leaves[i])
            if all(gk is None and gv is None for gk, gv in adjoint):
                continue  # no later turn had a scored token
            offset_i, tokens_i, _ = ctx.span(ctx.turns[i])
            spans.append((len(tokens_i), offset_i))
            if self.replay_mode == "retain":
                produced = ctx.kept[i]
            else:
                ids = torch.tensor(tokens_i, dtype=torch.long, device=self.policy.device)
                _, produced = self.policy.span_forward(ids, offset_i, ctx.past(i),
                                                       stop_after_kv=True)
            backward_kv(produced, adjoint)
        self._fold()
        if ctx.prompt is not None:
            ctx.prompt.fold_direct(1.0, ctx.prompt_leaves)
        return spans

    def _prompt_for(self, turn: TurnSource) -> SharedPrefix | None:
        """The group's shared prompt (built from its first served turn 0), if this turn
        starts with it. Members' prompt adjoints are summed and pushed back once."""
        if not self.cfg.shared_prefix:
            return None
        g = turn.group_id
        if g not in self.prompts:
            self.prompts[g] = SharedPrefix.build(self.policy, turn, dtype=self.acc.dtype)
            if self.prompts[g] is not None:
                self.kv_live_bytes += 2 * kv_bytes(self.prompts[g].produced)
        prompt = self.prompts[g]
        return prompt if prompt is not None and prompt.covers(turn) else None

    def _prompt_done(self, g: str) -> None:
        """After the group's last trajectory completes: one backward through its prompt."""
        self.open_members[g] -= 1
        if self.open_members[g] == 0:
            prompt = self.prompts.pop(g, None)
            if prompt is not None:
                self.kv_live_bytes -= 2 * kv_bytes(prompt.produced)
            start, cpu0 = self._now(), time.thread_time()
            ran = prompt is not None and prompt.backward_prefix(1.0, 0.0)
            n = len(prompt) if prompt is not None else 0
            del prompt  # its K/V and graph are freed inside the timing
            if ran:
                self._fold()
                self.trace.append(DeferredRecord(
                    update=self.version, rank=self.policy.par.rank, work="prefix",
                    group_id=g, traj_id=None, ready=start, start=start, end=self._now(),
                    cpu=time.thread_time() - cpu0, spans=[(n, 0)]))

    def _fold(self) -> None:
        self.acc.fold_direct(self.policy.grad_buffers(), 1.0)
        self.policy.zero_grads()

    # --- barrier and step -----------------------------------------------------------------

    def close(self, export_grad: bool = False) -> UpdateResult:
        if self.plan is None:
            raise RuntimeError("close() before begin(): no batch is open")
        missing = [f"{t}#{j}" for t, n in self.n_turns.items() if t in self.mine
                   for j in range(n) if f"{t}#{j}" not in self.arrived]
        n_missing = int(self.policy.dp_sum(len(missing)))  # agree before the collective step
        if n_missing:
            raise SourceError(f"batch for policy version {self.version} closed with {n_missing} "
                              f"turns missing; on this rank (trajectory#turn): {missing}")
        held = sorted(self.held, key=lambda t: (t.traj_id, t.turn)) \
            if self.schedule == "sync" else self.held
        self._release(held)
        self.held = []
        self._drain()
        assert not self.released and not self.ctx, "batch closed with turns left"
        scored = int(self.policy.dp_sum(self.scored_local))
        step = self.policy.apply_and_step(self.acc.batch, 1.0 / scored if scored else 0.0,
                                          export_grad=export_grad)
        served = sum(1 for r in self.trace if isinstance(r, SourceRecord))
        self.trace.append(UpdateRecord(
            update=self.version, rank=self.policy.par.rank, objective=self.cfg.objective,
            schedule=self.schedule, n_groups=self.plan.n_groups, n_sources=served,
            scored_tokens=scored, accum_peak_bytes=self.acc.peak_bytes,
            accum_bound_bytes=self.acc.bound_bytes, kv_peak_bytes=self.kv_peak_bytes,
            grad_norm=step.grad_norm, ok=step.ok))
        result = UpdateResult(
            policy_version=self.version, ok=step.ok, grad_norm=step.grad_norm,
            n_sources=served, scored_tokens=scored,
            accum_peak_bytes=self.acc.peak_bytes, accum_bound_bytes=self.acc.bound_bytes,
            grad=step.grad, trace=self.trace, kv_peak_bytes=self.kv_peak_bytes)
        self.version += 1
        self.plan = None
        return result

    def waiting_for(self) -> list[str]:
        """Turns (trajectory#turn) of this rank's trajectories that have not arrived yet."""
        if self.plan is None:
            return []
        return [f"{t}#{j}" for t, n in self.n_turns.items() if t in self.mine
                for j in range(n) if f"{t}#{j}" not in self.arrived]

    def abort(self) -> None:
        self.acc.reset()
        self.policy.zero_grads()
        self.ctx = {}
        self.continuing = {}
        self.starting = {}
        self.prompts = {}
        self.plan = None

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _note(self, turn: TurnSource, **fields) -> None:
        rec = next(r for r in reversed(self.trace)
                   if isinstance(r, SourceRecord) and r.traj_id == turn.traj_id
                   and r.turn == turn.turn)
        for k, v in fields.items():
            setattr(rec, k, v)
