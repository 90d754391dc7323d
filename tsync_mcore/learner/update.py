"""One update of the streaming learner, top to bottom, for every objective (docs/design/learner.md).

    begin(plan)      a BatchState for the batch (learner/batch.py): its groups, how sources
                     reach the DP ranks, the release queue
    submit(source)   check → record → release per schedule → serve what is servable
    serve            a pass over released units: forward, fused scored log-prob, backward
                     into the grad buffers (serving/: the kind's loss), then the fold —
                     straight into the batch once the group's coefficient is known
    close()          DP agreement on what trains → serve what is left → deferred scalar
                     (1/n_groups, 1/N_k, 1/B or 1/(B·H): objectives/token_norm.py) → reduce
                     → clip → exactly one optimizer step; the BatchState is dropped

That is the direct-fold path, read in this order below. Its variants sit beside it:
  packed     direct folds of several units in one pass, up to learner.max_tokens_per_pass
             tokens (`serve_pass`, the kinds' `serve_pack`; pass_cost.py says when a pair
             pass should wait to pack)
  pair       a unit of a group whose rewards are not all known folds into the group's own
             sums, combined into the batch once they are (serving/trajectory.py, turn.py)
  EP         model.ep > 1: passes in lockstep over the DP ranks (lockstep.py)
  mini-batch learner.minibatches > 1: the later PPO mini-batches served and stepped at
             close (minibatch.py)
and the live path's exits: group_rewards() (balanced routing: rewards of members served on
other ranks), drop_group() / reject() (a group leaves the update; nothing of it trains).

The objective's math is in `objectives/`; when a unit may run in `schedule.py`. Nothing
touches the parameters before close() has checked the whole batch, so an error at any
point leaves θ and the optimizer intact.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from tsync_mcore.channel.sources import BatchPlan, SourceError, assign_groups, check_version
from tsync_mcore.config import LearnerConfig
from tsync_mcore.learner import lockstep
from tsync_mcore.learner.accumulators import GradAccumulators, f32
from tsync_mcore.learner.batch import BatchState, lag
from tsync_mcore.learner.figures import lag_figures, regularizer_figures
from tsync_mcore.learner.minibatch import MiniBatches
from tsync_mcore.learner.pass_cost import PassCost
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.reference import Reference
from tsync_mcore.learner.schedule import ASYNC_SCHEDULES, ReadinessQueue, Service
from tsync_mcore.learner.serving import SOURCE_KINDS
from tsync_mcore.learner.serving.experts import ExpertRoutes
from tsync_mcore.model.span import KV, kv_bytes
from tsync_mcore.objectives import OBJECTIVES
from tsync_mcore.objectives.grpo import STD_DDOF
from tsync_mcore.objectives.off_policy import OffPolicy
from tsync_mcore.objectives.regularizers import Regularizer
from tsync_mcore.objectives.token_norm import TOKEN_NORMS
from tsync_mcore.observability.trace import DeferredRecord, Record, SourceRecord, UpdateRecord, tokens_digest

ACCUM_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# why a group left the update under learner.filter_groups (UpdateRecord.dropped_groups)
FILTERED = "uniform rewards (learner.filter_groups: zero_std)"


@dataclass
class UpdateResult:
    summary: UpdateRecord  # what the update did on this rank (also the trace's last record)
    grad: dict[str, torch.Tensor] | None  # g_k, HF names, when asked for
    trace: list[Record] = field(default_factory=list)
    # learner.minibatches > 1: each mini-batch step's g (the first is `grad`), when asked
    minibatch_grads: list = field(default_factory=list)
    minibatch_params: list = field(default_factory=list)  # θ after each step but the last

    @property
    def policy_version(self) -> int:  # the version the batch was sampled from (θ_k)
        return self.summary.update


def max_lag(cfg: LearnerConfig, schedule: str | None = None) -> int:
    """How many updates behind θ_k a source of `schedule` (default cfg's) may have been
    sampled: 0 for the synchronous schedules (zero staleness), 1 for one_step_off,
    learner.max_staleness for fully_async."""
    schedule = schedule or cfg.schedule
    if schedule not in ASYNC_SCHEDULES:
        return 0
    return 1 if schedule == "one_step_off" else cfg.max_staleness


class Learner:
    def __init__(self, cfg: LearnerConfig, policy: Policy, policy_version: int = 0):
        if cfg.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {cfg.objective!r} (have {sorted(OBJECTIVES)})")
        self.cfg = cfg
        self.policy = policy
        self.version = policy_version
        self.objective = OBJECTIVES[cfg.objective]
        if cfg.token_norm not in TOKEN_NORMS:  # "auto"/"global": a config never validated
            raise ValueError(f"learner.token_norm {cfg.token_norm!r} is not resolved; build the "
                             f"config with load_config (LearnerConfig.validate resolves it)")
        self.norm = TOKEN_NORMS[cfg.token_norm]
        self.adv_ddof = STD_DDOF[cfg.adv_std]
        self.kind = SOURCE_KINDS[self.objective.source](self)
        # MoE: the experts each forward routes a position to (learner.routing_replay)
        self.routes = ExpertRoutes(cfg.routing_replay, policy)
        if policy.ep_size > 1 and (self.kind.name != "trajectory" or cfg.shared_prefix):
            raise ValueError(f"model.ep {policy.ep_size}: the learner serves expert-parallel "
                             f"ranks in lockstep for GRPO-family objectives with "
                             f"learner.shared_prefix false only (docs/guide/moe.md)")
        # KL to the reference and the entropy bonus (objectives/regularizers.py): the
        # reference model is built only when the KL term is on
        self.reg = Regularizer(cfg.kl_coef, cfg.kl_estimator, cfg.entropy_coef)
        self.reference = Reference(policy.cfg, policy) if self.reg.needs_reference else None
        if self.reference is not None and self.reference.every and policy_version:
            self.reference.resume(policy_version)
        # a group held open keeps its members' regularisers apart (G3) when pairs fold
        aux_vectors = int(self.reg.active and self.objective.group_vectors == 2)
        self.acc = GradAccumulators(policy.grad_buffers(), cfg.k_open, cfg.accum,
                                    dtype=ACCUM_DTYPES[cfg.accum_dtype],
                                    per_group=self.objective.group_vectors + aux_vectors)
        self.kv_per_token = 0  # K/V bytes of one token on this rank, once a forward showed it
        # Longest source accepted: the model's positions, or less (learner.max_tokens).
        self.max_tokens = min(policy.spec.max_position, cfg.max_tokens or policy.spec.max_position)
        # learner.is_correction/is_cap, and the mismatch sums of the sources served since close
        self.off_policy = OffPolicy(cfg.is_correction, cfg.is_cap, policy.device,
                                    low=cfg.is_low)
        # Packed serving (learner.max_tokens_per_pass): direct-fold units run together in
        # one forward/backward; 0 (or a model that cannot run packed forwards): one by one.
        self.pack_budget = cfg.max_tokens_per_pass
        why = policy.packable if self.pack_budget else None
        if why is not None:
            print(f"learner: learner.max_tokens_per_pass={self.pack_budget} but sources are "
                  f"served one by one: {why}", file=sys.stderr, flush=True)
            self.pack_budget = 0
        self.cost = PassCost()  # learner.pack_arrivals: the live trainer turns it on
        self.batch: BatchState | None = None  # the open batch, from begin() to its step

    # --- the update: begin → submit → serve → close ---------------------------------------

    def begin(self, plan: BatchPlan, group_tokens: dict[str, int] | None = None,
              schedule: str | None = None, routing: str = "static",
              t0: float | None = None) -> None:
        """`schedule` overrides the configured release schedule for this batch only; `t0`
        (perf_counter, default now) is the origin of the trace's times.

        `routing` says how sources reach the DP ranks (tsync_mcore.channel.routing): "static", each
        group to its `assign_groups` owner (sources of other groups may be submitted too and
        only lend their outcomes); "balanced", each source to whichever rank the rollout
        chose, so this rank serves every source it is given and learns the rewards of
        members served elsewhere from `group_rewards`."""
        if self.batch is not None:
            raise RuntimeError(f"batch for policy version {self.version} is still open")
        if routing not in self.objective.routings:
            raise ValueError(f"routing {routing!r}: the {self.cfg.objective} objective routes "
                             f"{' or '.join(self.objective.routings)}")
        schedule = schedule or self.cfg.schedule
        lockstep.check(self.policy.ep_size, routing, schedule)
        self.batch = st = BatchState(
            plan=plan, schedule=schedule, routing=routing, max_lag=max_lag(self.cfg, schedule),
            owner=assign_groups(plan, group_tokens or {}, self.policy.par.dp_size),
            member_of={t: g for g, ts in plan.groups.items() for t in ts},
            t0=time.perf_counter() if t0 is None else t0,
            kl=torch.zeros((), dtype=torch.float64, device=self.policy.device))
        # learner.minibatches > 1: the queue streams mini-batch 1; the later ones wait for
        # close (learner/minibatch.py)
        st.mb = MiniBatches(self, plan, self.cfg.minibatches) \
            if self.cfg.minibatches > 1 else None
        st.queue = ReadinessQueue(schedule, plan if st.mb is None else st.mb.first,
                                  self.cfg.k_open, opens=self.kind.opens, fits=self._fits,
                                  capped=self.kind.capped)
        self.acc.reset()
        self.routes.begin()
        self.off_policy.reset()  # an aborted batch's mismatch is not this one's
        try:
            self.kind.begin()
        except SourceError:
            self.batch = None  # the registration itself is refused: no batch is open
            raise

    def submit(self, src, arrived: float | None = None, serve: bool = True) -> None:
        """Accept a ready source and serve what is servable now (`serve=False`: leave that
        to `serve_next`, so a caller holding more arrivals hands them all over first).
        `arrived`: perf_counter time the source reached this process (default: now), so the
        trace's ready time is not delayed by the learner being busy."""
        self._check(src)
        st, g = self.batch, src.group_id
        st.arrived[src.key] = src
        self.kind.arrived(src)
        if g in st.dropped:
            return  # a member of a group that left the update: nothing of it trains
        if st.routing == "balanced" or st.owner[g] == self.policy.par.dp_rank:
            later = st.mb is not None and g in st.mb.later
            if not later:
                self.routes.arrived(src)  # served here: its experts are booked here
                st.queue.arrive(src)
            st.records[src.key] = SourceRecord(
                update=self.version, rank=self.policy.par.rank,
                source=self.kind.name, traj_id=src.traj_id,
                group_id=g, turn=getattr(src, "turn", None),
                segment=src.segment if getattr(src, "n_segments", 1) > 1 else None,
                policy_version=src.policy_version,
                scored_tokens=src.n_scored, policy_lag=self.version - src.policy_version,
                lagged_tokens=lag(src, self.version)[1],
                ready=self.now() if arrived is None else arrived - st.t0,
                tokens_sha256=tokens_digest(src.tokens, src.scored_mask),
                reward=getattr(src, "reward", None))
            if later:  # its old log-probs now, its service after mini-batch 1's step
                st.mb.hold(src)
        self._maybe_complete(g)
        if serve:
            self._drain()

    def serve_next(self) -> bool:
        """Serve the next servable unit (with packing: the next pass, which may hold several
        units); False when there is none now."""
        units = self.take_pass()
        self.run_pass(units)
        return bool(units)

    def serve_pass(self, units: list[Service]) -> None:
        """One pass: the kind's forward/backward and fold of its units (one unit, or a packed
        pass of several: one forward/backward, each with its own coefficient in the loss,
        folded once), recorded; then each unit's deferred work and its group's finish, in
        order, as if served alone."""
        st = self.batch
        if units[0].source is not None:
            start, cpu0 = self.now(), time.thread_time()
            # its tensors are freed by the time it returns: timed too
            spans = (self.kind.serve_pack(units) if len(units) > 1
                     else [self.kind.serve(units[0])])
            self.record_pass([(u.source, u, span) for u, span in zip(units, spans)],
                             start, self.now(), time.thread_time() - cpu0)
            st.open_peak_bytes = max(st.open_peak_bytes, self.open_bytes())
        where = f", packed pass {st.passes}" if len(units) > 1 else ""
        for u in units:
            src, g = u.source, u.group_id
            if src is not None:
                self.kind.after(u)  # deferred work (its own trace records, after this one)
                self._check_finite(g, f"{type(src).__name__} {src.key!r} (group {g!r}{where})")
            if u.last_here:
                self.kind.finish(u)
                self._check_finite(g, f"the close of group {g!r} (its shared prompt and sum)")

    def close(self, export_grad: bool = False) -> UpdateResult:
        st = self.batch
        if st is None:
            raise RuntimeError("close() before begin(): no batch is open")
        dropped = self._agree()
        st.queue.close()
        self._drain()
        self.flush_grads()
        assert st.queue.pending() == 0 and not self.acc.open, "batch closed with work left"

        groups = list(st.plan.groups)
        scored = int(self.policy.dp_sum(sum(st.scored.values())))
        first = groups if st.mb is None else st.mb.parts[0]  # what the queue served
        kept = [g for g in first if g not in dropped]
        n_groups = len(kept)
        n_trajectories = sum(len(st.plan.groups[g]) for g in kept)
        scale = self.norm.batch_scale(n_groups, n_trajectories, scored,
                                      self.cfg.token_norm_constant)
        # The accumulator holds the descent direction −Σ_G g_G; one step per batch (per
        # mini-batch with learner.minibatches > 1: the later ones follow here).
        if st.mb is not None:
            st.mb.prepare()  # θ_k's log-probs of what is still without them (sync)
        step = self.policy.apply_and_step(self.acc.batch, scale, export_grad=export_grad,
                                          schedule_step=st.mb is None)
        steps = [step]
        if st.mb is not None and step.ok:
            steps += st.mb.run(export_grad, set(dropped))
            n_groups = len(groups) - len(dropped)
            scored += sum(st.minibatch_tokens)
        summary = self._summary(steps, dropped, n_groups, scored)
        st.trace.append(summary)
        result = UpdateResult(summary=summary, grad=step.grad, trace=st.trace,
                              minibatch_grads=[s.grad for s in steps],
                              minibatch_params=st.mb.params if st.mb is not None else [])
        if step.ok:  # a skipped step leaves θ_k, so the next batch is again for version k
            self.version += 1  # (mini-batch 1's step applied: θ moved, later ones or not)
            if self.reference is not None:
                self.reference.refresh(self.version)
        self.cost.batch_ended(st.records.values())
        self.batch = None
        return result

    def _agree(self) -> list[str]:
        """Every rank must agree before the collective step: what was dropped anywhere, what
        cannot be taken out anywhere, and then what is still missing. Returns the groups
        dropped on any rank (dropped here too now)."""
        st = self.batch
        groups = list(st.plan.groups)
        n = len(groups)
        flags = self.policy.dp_sum_vector(
            [float(g in st.dropped) for g in groups]
            + [float(g in self.acc.committed) for g in groups]
            + [float(st.dropped.get(g) == FILTERED) for g in groups])
        dropped_anywhere = [g for g, d in zip(groups, flags) if d]
        late = [g for g, d, c in zip(groups, flags, flags[n:2 * n]) if d and c]
        if late:
            raise SourceError(f"batch for policy version {self.version}: groups {late} were "
                              f"dropped after their gradient reached the batch on some rank; "
                              f"the update cannot leave them out exactly")
        filtered = {g for g, f in zip(groups, flags[2 * n:]) if f}
        for g in dropped_anywhere:
            self.drop_group(g, st.dropped.get(g, FILTERED if g in filtered
                                              else "dropped on another rank"))
        problems = self._incomplete()
        n_bad = int(self.policy.dp_sum(len(problems)))
        if n_bad:
            raise SourceError(f"batch for policy version {self.version} closed incomplete "
                              f"({n_bad} problems over all ranks); on this rank: {problems}")
        return dropped_anywhere

    def _summary(self, steps: list, dropped: list[str], n_groups: int,
                 scored: int) -> UpdateRecord:
        st, last = self.batch, steps[-1]
        return UpdateRecord(
            update=self.version, rank=self.policy.par.rank, objective=self.cfg.objective,
            schedule=st.schedule, n_groups=n_groups,
            n_sources=sum(1 for r in st.records.values() if r.served), scored_tokens=scored,
            dropped_groups={g: st.dropped[g] for g in dropped},
            rejected_sources=list(st.rejected), open_bound=self.open_bound,
            accum_peak_bytes=self.acc.peak_bytes, accum_bound_bytes=self.acc.bound_bytes,
            accum_params=self.acc.numel,
            open_peak_bytes=st.open_peak_bytes,
            kv_peak_bytes=self.kind.kv_peak_bytes,
            head_peak_bytes=self.policy.take_head_peak(), grad_norm=last.grad_norm,
            lr=last.lr, ok=all(s.ok for s in steps), nonfinite_sources=list(st.nonfinite),
            dummy_passes=st.dummy_passes, minibatch_steps=sum(s.ok for s in steps),
            **lag_figures(self.policy, self.off_policy, st, dropped, scored),
            **regularizer_figures(self.policy, self.reg, self.reference, st),
            **(st.mb.figures() if st.mb is not None else {}))

    # --- the one record of a served pass --------------------------------------------------

    def record_pass(self, units: list[tuple[object, Service | None, dict]], start: float,
                    end: float, cpu: float, minibatch: int = 1) -> None:
        """Write one pass into its sources' records, the trace and the batch's sums (the only
        place a served source's record is filled). `units`: (source, its Service — None for
        a later PPO mini-batch's —, the span it ran). A pass of several sources counts as a
        packed pass (`pass_id`); each keeps its own span (the pass's FLOPs are the sum of
        its segments'), and the pass's wall and CPU time are split over them in proportion
        to their span tokens, as consecutive intervals, so that busy time (Σ end − start)
        stays the pass's time."""
        st = self.batch
        packed = len(units) > 1
        st.passes += packed
        total = sum(span["span_tokens"] for _, _, span in units) or 1
        t = start
        for src, svc, span in units:
            rec = st.records[src.key]
            if packed:
                share = span["span_tokens"] / total
                rec.start, rec.end, rec.cpu = t, t + (end - start) * share, cpu * share
                t = rec.end
            else:
                rec.start, rec.end, rec.cpu = start, end, cpu
            rec.fold = "direct" if svc is None else svc.fold
            if svc is not None:
                rec.closes_group, rec.open_groups = svc.closes_group, st.queue.open_groups
            rec.minibatch = minibatch
            rec.span_tokens, rec.context, rec.logits = (span["span_tokens"], span["context"],
                                                        span["logits"])
            rec.fused_head = rec.logits and self.policy.fused_head
            # what the reference forwarded for it: all of it, when it scores
            rec.reference_tokens = (len(src.tokens) if self.reference is not None
                                    and src.n_scored else 0)
            rec.pass_id = st.passes if packed else None
            st.trace.append(rec)
            st.scored[src.group_id] = st.scored.get(src.group_id, 0) + src.n_scored
            st.lag_sums[src.key] = lag(src, self.version)[0]

    # --- variants: packed passes, EP lockstep ---------------------------------------------

    def take_pass(self) -> list[Service]:
        """The units of the next pass, taken from the queue (empty: none servable now)."""
        st = self.batch
        if not self.pack_budget:
            svc = st.queue.next()
            return [] if svc is None else [svc]
        may_pair = self.cost.pair_pays(self.now(), self.kind.name)
        units = st.queue.next_pack(self.pack_budget, self.kind.pack_tokens,
                                   self.kind.packable, may_open=not self.cfg.max_open_bytes,
                                   pairs=self.kind.packs_pairs, may_pair=may_pair)
        st.pairs_held += not (units or may_pair)
        return units

    def run_pass(self, units: list[Service]) -> None:
        """Serve `units` (none: nothing); with learner.pack_arrivals, time the pass."""
        if not units:
            return
        t = time.perf_counter()
        self.serve_pass(units)
        if self.cost.on and units[0].source is not None:
            tokens = sum(self.kind.pack_tokens(u.source) for u in units if u.source is not None)
            self.cost.observe(units[0].fold, len(units), tokens, time.perf_counter() - t)

    def _drain(self) -> None:
        if self.policy.ep_size == 1:
            while self.serve_next():
                pass
            return
        # ep > 1: every rank calls _drain at the same points (static routing in the replay
        # harness: each rank is given every source), and serves in lockstep rounds
        while self.serve_together()[0]:
            pass

    def serve_together(self, closed: bool = True, stopping: bool = False
                       ) -> tuple[bool, bool, bool]:
        """ep > 1: one lockstep round over the DP ranks (lockstep.serve_together)."""
        return lockstep.serve_together(self, closed, stopping)

    # --- what the serving kinds call back -------------------------------------------------

    def fold_direct(self, g: str | list[str], grads: list[torch.Tensor], coef: float) -> None:
        """batch += coef·grads: once there, the group (every group of a packed pass) cannot
        be taken out of the update."""
        st = self.batch
        if st.unfolded:  # the buffers also hold gradient of coefficient 1 (fold_later)
            assert coef == 1.0, "fold_direct with a coefficient over unfolded gradient"
            st.unfolded = False  # folded now with the rest; the caller zeroes the buffers
        self.acc.fold_direct(grads, coef, [g] if isinstance(g, str) else g)

    def fold_later(self, g: str | list[str]) -> None:
        """batch += the grad buffers, left in them: the next backward of coefficient 1 (the
        next direct pass, a group's shared prompt) adds to them and one fold takes the sum
        (sync: one fold per update instead of one per pass and per group). Whatever needs
        clean buffers calls `flush_grads` before its backward: a lone source's fold with its
        own coefficient and a pair pass (TrajectoryKind, the only kind that folds later), a
        per-source finite check, an EP dummy pass, the step. FP64 accumulators fold each
        backward as it comes."""
        self.acc.commit([g] if isinstance(g, str) else g)
        if self.acc.dtype != self.policy.grad_buffers()[0].dtype:
            self.flush_grads(force=True)
            return
        self.batch.unfolded = True

    def flush_grads(self, force: bool = False) -> None:
        """Fold what `fold_later` left in the grad buffers into the batch; zero them."""
        st = self.batch
        if st.unfolded or force:
            self.acc.fold_direct(self.policy.grad_buffers(), 1.0)
            self.policy.zero_grads()
            st.unfolded = False

    def regularizer(self, tokens, scored_mask, offset: int, logp: torch.Tensor,
                    entropy: torch.Tensor, weight: float) -> torch.Tensor | None:
        """weight·R for one source's scored tokens (objectives/regularizers.py), with the
        graph; None when neither term is on. `weight`: the part of the token coefficient
        known at arrival (w(L_i), and 1/m_G when the norm keeps the group mean). Its KL
        sum goes to the update's `kl_mean`."""
        if not self.reg.active:
            return None
        ref = None
        if self.reference is not None:
            ref = self.reference.logprobs(tokens, scored_mask, offset)
        r, kl = self.reg.loss(logp, entropy, ref)
        st = self.batch
        st.kl += kl
        st.kl_tokens += logp.numel()
        return f32(weight) * r

    def defer(self, rec: DeferredRecord) -> None:
        self.batch.trace.append(rec)

    def saw_kv(self, kv: list[KV], n_tokens: int) -> None:
        if n_tokens and not self.kv_per_token:
            self.kv_per_token = kv_bytes(kv) // n_tokens

    def now(self) -> float:
        """Trace time: seconds since the open batch's origin."""
        return time.perf_counter() - self.batch.t0

    # --- checks ---------------------------------------------------------------------------

    def group_rewards(self, group_id: str, rewards: dict[str, float], serve: bool = True) -> None:
        """The rollout's announcement of every reward of a finished group (balanced routing:
        some members were served on other ranks). Checked against what arrived here.
        `serve`: as in `submit`."""
        if self.batch is None:
            raise RuntimeError("group_rewards() before begin(): no batch is open")
        if group_id in self.batch.dropped:
            return
        self.kind.announce(group_id, rewards)
        self._maybe_complete(group_id)
        if serve:
            self._drain()

    def _check(self, src) -> None:
        st = self.batch
        if st is None:
            raise RuntimeError("submit() before begin(): no batch is open")
        if not isinstance(src, self.kind.source_type):
            raise SourceError(f"a {type(src).__name__} in a {self.cfg.objective} batch, which "
                              f"trains on {self.kind.source_type.__name__}s")
        self.kind.validate(src)
        name = f"{type(src).__name__} {src.key!r}"
        self.routes.check(name, src)
        check_version(name, src.policy_version, self.version, st.max_lag)
        if src.token_versions and max(src.token_versions) > self.version:
            raise SourceError(f"{name}: a token sampled by policy version "
                              f"{max(src.token_versions)}, after the current version "
                              f"{self.version}; future tokens are never trained on")
        members = st.plan.groups.get(src.group_id)
        if members is None:
            raise SourceError(f"{name}: group {src.group_id!r} is not registered in this batch")
        if st.member_of.get(src.traj_id) != src.group_id:
            raise SourceError(f"{name}: trajectory not one of the {len(members)} registered for "
                              f"group {src.group_id!r}; the group would be larger than registered")
        if src.key in st.arrived:
            raise SourceError(f"{name}: duplicate, already received in this batch")
        self.kind.check(src)

    def _maybe_complete(self, g: str) -> None:
        st = self.batch
        if g not in st.dropped and not st.queue.is_complete(g) and self.kind.complete(g):
            if self._filtered(g):  # DAPO dynamic sampling: before anything of it is committed
                self.drop_group(g, FILTERED)
                return
            if st.mb is None or g not in st.mb.later:
                st.queue.complete(g)

    def _filtered(self, g: str) -> bool:
        """learner.filter_groups zero_std: every reward of the complete group `g` equal."""
        if self.cfg.filter_groups != "zero_std":
            return False
        rewards = [self.kind.rewards[t] for t in self.batch.plan.groups[g]]
        return all(r == rewards[0] for r in rewards)

    def _check_finite(self, g: str, what: str) -> None:
        """learner.check_finite=source: name the first unit after which the sums this rank
        holds are not finite (checking once per source costs one pass over them)."""
        if self.cfg.check_finite == "source":
            self.flush_grads()
        if self.cfg.check_finite == "source" and not self.batch.nonfinite \
                and not self.policy.sums_finite(self.acc.holding(g)):
            self.batch.nonfinite.append(what)

    # --- admission ------------------------------------------------------------------------

    def open_bytes(self) -> int:
        """Bytes held by open groups now: their sums, K/V leaves + adjoints, prompts."""
        return sum(self.acc.group_bytes(g) for g in self.acc.open) + self.kind.held_bytes()

    def _fits(self, unit) -> bool:
        budget = self.cfg.max_open_bytes
        return not budget or self.open_bytes() + self.kind.estimate(unit) <= budget

    @property
    def open_bound(self) -> str:
        b = f"k_open={self.cfg.k_open} groups"
        budget = self.cfg.max_open_bytes
        return b + (f", max_open_bytes={budget}" if budget else "")

    # --- leaving groups out ---------------------------------------------------------------

    def drop_group(self, group_id: str, reason: str) -> bool:
        """Group `group_id` leaves this update (on every rank, once each has been told or at
        close): nothing of it trains, n_groups and N_k do not count it. False if it had put
        work into the batch accumulator here already (then close() refuses the batch)."""
        st = self.batch
        if st is None:
            raise RuntimeError("drop_group() before begin(): no batch is open")
        if group_id not in st.plan.groups:
            raise SourceError(f"drop of group {group_id!r}: not registered in this batch")
        if group_id in st.dropped:
            return group_id not in self.acc.committed
        st.dropped[group_id] = reason
        st.queue.drop(group_id)
        self.kind.drop(group_id)
        self.routes.drop(st.plan.groups[group_id])
        self.acc.discard_group(group_id)
        st.scored.pop(group_id, None)
        return group_id not in self.acc.committed

    def reject(self, src, reason: str) -> list[str]:
        """The live path's answer to a source `submit` refused: record it, and drop the
        group that registered its trajectory unless a valid copy of it arrived already
        (a duplicate leaves the first copy standing). Returns the groups dropped."""
        key = str(getattr(src, "key", "?"))
        st = self.batch
        g = None if key in st.arrived else st.member_of.get(getattr(src, "traj_id", None))
        return self._reject(key, reason, g)

    def reject_rewards(self, group_id: str, reason: str) -> list[str]:
        """The live path's answer to a refused GroupRewards: its group cannot be trusted."""
        g = group_id if self.batch is not None and group_id in self.batch.plan.groups else None
        return self._reject(f"rewards of {group_id}", reason, g)

    def _reject(self, what: str, reason: str, g: str | None) -> list[str]:
        self.batch.rejected.append((what, reason))
        if g is None or g in self.batch.dropped:
            return []
        self.drop_group(g, f"{what}: {reason}")
        return [g]

    # --- what is missing ------------------------------------------------------------------

    def _incomplete(self) -> list[str]:
        """What keeps this batch from closing, as seen from this rank (a collective)."""
        st = self.batch
        if st.routing == "static":
            return [f"{k} missing" for k in self._missing()]
        # Balanced: every trajectory served on exactly one DP rank, and every group with
        # members here complete (its other members' rewards announced).
        order = [t for g, ts in st.plan.groups.items() if g not in st.dropped for t in ts]
        here = {s.traj_id for s in st.arrived.values()}  # a segmented one's segments: once
        mine = [1.0 if t in here else 0.0 for t in order]
        counts = self.policy.dp_sum_vector(mine)
        problems = [f"{t} arrived on {int(n)} DP ranks" for t, n, m in zip(order, counts, mine)
                    if n != 1 and (m or self.policy.par.dp_rank == 0)]
        return problems + [f"group {g}: rewards of its members on other ranks never announced"
                           for g in self._unannounced()]

    def waiting_for(self) -> list[str]:
        """What this rank still waits for: units of its groups (static routing) or the
        rewards of groups it serves part of (balanced)."""
        if self.batch is None:
            return []
        if self.batch.routing == "balanced":
            return [f"rewards of group {g}" for g in self._unannounced()]
        return self._missing()

    def _missing(self) -> list[str]:
        """Static routing: registered units of this rank's groups not arrived yet."""
        st, me = self.batch, self.policy.par.dp_rank
        return [k for g, ts in st.plan.groups.items()
                if st.owner[g] == me and g not in st.dropped
                for t in ts for k in self.kind.unit_keys(t) if k not in st.arrived]

    def _unannounced(self) -> list[str]:
        """Balanced routing: groups served partly here whose rewards are not all known."""
        st = self.batch
        here = {r.group_id for r in st.records.values()}  # groups with units given here
        return [g for g in here if g not in st.dropped and not self._complete(g)]

    def _complete(self, g: str) -> bool:
        """Every reward of group `g` known here (a later PPO mini-batch's group never
        enters the queue)."""
        st = self.batch
        if st.mb is not None and g in st.mb.later:
            return self.kind.complete(g)
        return st.queue.is_complete(g)

    def abort(self) -> None:
        """Drop the open batch without touching θ (e.g. after a rejected close)."""
        self.acc.reset()
        self.policy.zero_grads()
        if self.batch is not None:
            self.kind.begin()  # frees every context and prompt
            self.routes.begin()
            self.cost.batch_ended(self.batch.records.values())
        self.batch = None
