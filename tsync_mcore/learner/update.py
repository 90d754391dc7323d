"""One update of the streaming learner, top to bottom, for every objective (docs/design/learner.md).

    begin(plan)       register the batch's groups (and turn counts), how sources reach the
                      DP ranks, and the release schedule
    submit(source)    validate → release per schedule → serve what is servable: forward,
                      fused scored log-prob, backward into the grad buffers, fold into the
                      group's own sums or, once the group is complete, into the batch
                      (those direct folds of several units run as one packed pass, up to
                      learner.max_tokens_per_pass tokens, and fold once)
    group_rewards()   (balanced routing) the rewards of members served on other ranks
    drop_group()      a group leaves the update (a rejected member on the live path): its
                      open sums and contexts are discarded, nothing of it trains
    close()           DP agreement on what trains → serve what is left → deferred scalar
                      (1/n_groups, 1/N_k, 1/B or 1/(B·H): objectives/token_norm.py) → reduce
                      → clip → exactly one optimizer step

The objective's math is in `objectives/`; what a source is and how one is served (GRPO
trajectories: G1'/G2 pairs and group rewards; OPD turns: K/V context and deferred replay)
in `serving/`; when a unit may run in `schedule.py`. Nothing touches the parameters before
close() has checked the whole batch, so an error at any point leaves θ and the optimizer
intact.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from tsync_mcore.learner.accumulators import GradAccumulators
from tsync_mcore.config import LearnerConfig
from tsync_mcore.model.span import KV, kv_bytes
from tsync_mcore.objectives import OBJECTIVES
from tsync_mcore.objectives.grpo import STD_DDOF
from tsync_mcore.objectives.off_policy import OffPolicy, mismatch
from tsync_mcore.objectives.regularizers import Regularizer
from tsync_mcore.learner.accumulators import f32
from tsync_mcore.learner.reference import Reference
from tsync_mcore.learner.minibatch import MiniBatches
from tsync_mcore.objectives.token_norm import TOKEN_NORMS
from tsync_mcore.learner.policy import Policy
from tsync_mcore.learner.schedule import ASYNC_SCHEDULES, ReadinessQueue, Service
from tsync_mcore.learner.serving import SOURCE_KINDS
from tsync_mcore.learner.serving.experts import ExpertRoutes
from tsync_mcore.channel.sources import BatchPlan, SourceError, assign_groups, check_version
from tsync_mcore.observability.trace import DeferredRecord, Record, SourceRecord, UpdateRecord, tokens_digest

ACCUM_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# why a group left the update under learner.filter_groups (UpdateRecord.dropped_groups)
FILTERED = "uniform rewards (learner.filter_groups: zero_std)"
# model.ep > 1: the schedules that serve a source only once its group's rewards are known
EP_SCHEDULES = ("sync", "group_ready")


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
        self._kl = torch.zeros((), dtype=torch.float64, device=policy.device)
        self._kl_tokens = 0
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
        self.plan: BatchPlan | None = None
        # Streaming's cost model (learner.pack_arrivals, GRPO; _pair_pays): what a pair pass
        # costs beyond the same sources' share of a packed pass, and when the previous
        # batch's last source arrived (trace time).
        # Off unless the live trainer turns it on (learner.pack_arrivals): replays and tests
        # that serve a batch twice must not depend on how fast they ran.
        self.cost_model = False
        self.pair_overhead_s: float | None = None
        self.direct_s_per_token: float | None = None  # the last packed direct pass's rate
        self.arrivals_end: float | None = None
        self.pairs_held = 0  # times this batch waited to pack instead of a pair pass

    # --- register -------------------------------------------------------------------------

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
        if self.plan is not None:
            raise RuntimeError(f"batch for policy version {self.version} is still open")
        if routing not in self.objective.routings:
            raise ValueError(f"routing {routing!r}: the {self.cfg.objective} objective routes "
                             f"{' or '.join(self.objective.routings)}")
        self.schedule = schedule or self.cfg.schedule
        self._check_ep(routing)
        self.max_lag = max_lag(self.cfg, self.schedule)
        self.routing = routing
        self.owner = assign_groups(plan, group_tokens or {}, self.policy.par.dp_size)
        if getattr(self, "records", None):  # the batch before: when its last source came
            self.arrivals_end = max(r.ready for r in self.records.values())
        self.plan = plan
        # learner.minibatches > 1: the queue streams mini-batch 1; the later ones wait for
        # close (learner/minibatch.py)
        self.mb = MiniBatches(self, plan, self.cfg.minibatches) \
            if self.cfg.minibatches > 1 else None
        self.queue = ReadinessQueue(self.schedule, plan if self.mb is None else self.mb.first,
                                    self.cfg.k_open, opens=self.kind.opens, fits=self._fits,
                                    capped=self.kind.capped)
        self.member_of = {t: g for g, ts in plan.groups.items() for t in ts}
        self.arrived: dict[str, object] = {}  # by unit key, served here or not
        self.records: dict[str, SourceRecord] = {}  # units given to this rank
        self.trace: list[Record] = []
        self.t0 = time.perf_counter() if t0 is None else t0
        self.scored: dict[str, int] = {}  # scored tokens served here, per group
        self.lag_sums: dict[str, int] = {}  # Σ over those tokens of their lag k − v, per unit
        self.committed: set[str] = set()  # groups with something in the batch accumulator
        self.dropped: dict[str, str] = {}
        self.rejected: list[tuple[str, str]] = []  # (source, why), refused here
        self.nonfinite: list[str] = []  # check_finite=source: the unit that broke the sums
        self.open_peak_bytes = 0
        self.pairs_held = 0
        self.passes = 0  # packed passes run in this batch (SourceRecord.pass_id)
        self.dummy_passes = 0  # ep > 1: passes run only to match other ranks' (no work)
        self.unfolded = False  # the grad buffers hold gradient already in the batch (fold_later)
        self.acc.reset()
        self.routes.begin()
        self.off_policy.reset()  # an aborted batch's mismatch is not this one's
        self._kl.zero_()
        self._kl_tokens = 0
        try:
            self.kind.begin()
        except SourceError:
            self.plan = None  # the registration itself is refused: no batch is open
            raise

    def _check_ep(self, routing: str) -> None:
        """model.ep > 1 (Config._check_expert_parallel says why): static routing, and only
        direct folds, so that each rank's buffers go to the batch as they are."""
        ep = self.policy.ep_size
        if ep > 1 and routing != "static":
            raise ValueError(f"routing {routing!r} with model.ep {ep}: ranks serving in "
                             f"lockstep must each be handed every source (static)")
        if ep > 1 and self.schedule not in EP_SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} with model.ep {ep}: only "
                             f"{' and '.join(EP_SCHEDULES)} fold every source directly")

    # --- stream ---------------------------------------------------------------------------

    def submit(self, src, arrived: float | None = None, serve: bool = True) -> None:
        """Accept a ready source and serve what is servable now (`serve=False`: leave that
        to `serve_next`, so a caller holding more arrivals hands them all over first).
        `arrived`: perf_counter time the source reached this process (default: now), so the
        trace's ready time is not delayed by the learner being busy."""
        self._check(src)
        g = src.group_id
        self.arrived[src.key] = src
        self.kind.arrived(src)
        if g in self.dropped:
            return  # a member of a group that left the update: nothing of it trains
        if self.routing == "balanced" or self.owner[g] == self.policy.par.dp_rank:
            later = self.mb is not None and g in self.mb.later
            if not later:
                self.routes.arrived(src)  # served here: its experts are booked here
                self.queue.arrive(src)
            self.records[src.key] = SourceRecord(
                update=self.version, rank=self.policy.par.rank,
                source=self.kind.name, traj_id=src.traj_id,
                group_id=g, turn=getattr(src, "turn", None),
                segment=src.segment if getattr(src, "n_segments", 1) > 1 else None,
                policy_version=src.policy_version,
                scored_tokens=src.n_scored, policy_lag=self.version - src.policy_version,
                lagged_tokens=self._lag(src)[1],
                ready=self.now() if arrived is None else arrived - self.t0,
                tokens_sha256=tokens_digest(src.tokens, src.scored_mask),
                reward=getattr(src, "reward", None))
            if later:  # its old log-probs now, its service after mini-batch 1's step
                self.mb.hold(src)
        self._maybe_complete(g)
        if serve:
            self._drain()

    def group_rewards(self, group_id: str, rewards: dict[str, float], serve: bool = True) -> None:
        """The rollout's announcement of every reward of a finished group (balanced routing:
        some members were served on other ranks). Checked against what arrived here.
        `serve`: as in `submit`."""
        if self.plan is None:
            raise RuntimeError("group_rewards() before begin(): no batch is open")
        if group_id in self.dropped:
            return
        self.kind.announce(group_id, rewards)
        self._maybe_complete(group_id)
        if serve:
            self._drain()

    def serve_next(self) -> bool:
        """Serve the next servable unit (with packing: the next pass, which may hold several
        units); False when there is none now."""
        units = self._take()
        self._run(units)
        return bool(units)

    def _take(self) -> list[Service]:
        """The units of the next pass, taken from the queue (empty: none servable now)."""
        if not self.pack_budget:
            svc = self.queue.next()
            return [] if svc is None else [svc]
        may_pair = self._pair_pays()
        units = self.queue.next_pack(self.pack_budget, self.kind.pack_tokens,
                                     self.kind.packable, may_open=not self.cfg.max_open_bytes,
                                     pairs=self.kind.packs_pairs, may_pair=may_pair)
        self.pairs_held += not (units or may_pair)
        return units

    def _pair_pays(self) -> bool:
        """May the next pass be a pair pass? A pair pass of p seconds started at t, when the
        last source is expected at E (the previous batch's), delays the packed pass after
        the rollout by max(0, t + p − E) and takes its sources' share q out of it: it pays
        unless t + p − E > q, i.e. unless t is within the pair pass's overhead p − q of E.
        Once E has passed unmet (a longer rollout), streaming resumes."""
        if not (self.cost_model and self.kind.name == "trajectory"
                and self.pair_overhead_s is not None and self.arrivals_end is not None):
            return True
        now = self.now()
        return not (self.arrivals_end - self.pair_overhead_s < now < self.arrivals_end)

    def _run(self, units: list[Service]) -> None:
        t = time.perf_counter()
        if len(units) > 1:
            self._serve_pack(units)
        elif units:
            self._serve(units[0])  # alone: exactly the one-by-one path
        if not (self.cost_model and units and units[0].source is not None):
            return
        wall = time.perf_counter() - t
        tokens = sum(self.kind.pack_tokens(u.source) for u in units if u.source is not None)
        if units[0].fold == "direct" and len(units) > 1:
            self.direct_s_per_token = wall / max(tokens, 1)
        elif units[0].fold == "pair":  # unknown packed rate yet: the whole pass is overhead
            self.pair_overhead_s = max(0.0, wall - (self.direct_s_per_token or 0.0) * tokens)

    def _check(self, src) -> None:
        if self.plan is None:
            raise RuntimeError("submit() before begin(): no batch is open")
        if not isinstance(src, self.kind.source_type):
            raise SourceError(f"a {type(src).__name__} in a {self.cfg.objective} batch, which "
                              f"trains on {self.kind.source_type.__name__}s")
        self.kind.validate(src)
        name = f"{type(src).__name__} {src.key!r}"
        self.routes.check(name, src)
        check_version(name, src.policy_version, self.version, self.max_lag)
        if src.token_versions and max(src.token_versions) > self.version:
            raise SourceError(f"{name}: a token sampled by policy version "
                              f"{max(src.token_versions)}, after the current version "
                              f"{self.version}; future tokens are never trained on")
        members = self.plan.groups.get(src.group_id)
        if members is None:
            raise SourceError(f"{name}: group {src.group_id!r} is not registered in this batch")
        if self.member_of.get(src.traj_id) != src.group_id:
            raise SourceError(f"{name}: trajectory not one of the {len(members)} registered for "
                              f"group {src.group_id!r}; the group would be larger than registered")
        if src.key in self.arrived:
            raise SourceError(f"{name}: duplicate, already received in this batch")
        self.kind.check(src)

    def _lag(self, src) -> tuple[int, int]:
        """(Σ of k − v over its scored tokens, scored tokens sampled by a version < k)."""
        if src.token_versions:
            lags = [self.version - v for m, v in zip(src.scored_mask, src.token_versions) if m]
            return sum(lags), sum(1 for x in lags if x > 0)
        lag = self.version - src.policy_version
        return lag * src.n_scored, src.n_scored if lag > 0 else 0

    def _maybe_complete(self, g: str) -> None:
        if g not in self.dropped and not self.queue.is_complete(g) and self.kind.complete(g):
            if self._filtered(g):  # DAPO dynamic sampling: before anything of it is committed
                self.drop_group(g, FILTERED)
                return
            if self.mb is None or g not in self.mb.later:
                self.queue.complete(g)

    def _filtered(self, g: str) -> bool:
        """learner.filter_groups zero_std: every reward of the complete group `g` equal."""
        if self.cfg.filter_groups != "zero_std":
            return False
        rewards = [self.kind.rewards[t] for t in self.plan.groups[g]]
        return all(r == rewards[0] for r in rewards)

    def _drain(self) -> None:
        if self.policy.ep_size == 1:
            while self.serve_next():
                pass
            return
        # ep > 1: every MoE pass is an all-to-all over the EP group, so DP ranks (EP groups
        # tile them) agree on each step: while any rank has work, each runs one model pass,
        # a real one or a dummy (docs/guide/moe.md). Every rank calls _drain at the same points
        # (static routing in the replay harness: each rank is given every source).
        while self.serve_together()[0]:
            pass

    def serve_together(self, closed: bool = True, stopping: bool = False
                       ) -> tuple[bool, bool, bool]:
        """ep > 1: one lockstep round over the DP ranks (a collective: every rank calls it
        the same number of times). Each rank serves its next pass, or a dummy pass when a
        peer runs one and it has none. `closed`: this rank has its batch's CloseBatch;
        `stopping`: this rank must stop. Returns (any rank served something, some rank is
        not closed yet, some rank is stopping); a stopping round serves nothing."""
        units = [] if stopping else self._take()
        mine = 2 if self._runs_pass(units) else 1 if units else 0
        most, waiting, stop = self.policy.dp_max_vector(
            [float(mine), float(not closed), float(stopping)])
        if stop:
            return False, bool(waiting), True  # the batch is abandoned: units need not run
        self._run(units)
        if most == 2 and mine < 2:
            self._dummy_pass()
        return most > 0, bool(waiting), False

    def _dummy_pass(self) -> None:
        """A pass with nothing to serve; the gradient the peers' tokens left on this rank's
        experts joins the batch (their coefficients are in their losses)."""
        self.flush_grads()  # the dummy pass zeroes the dense buffers
        self.policy.dummy_pass()
        self.fold_direct([], self.policy.grad_buffers(), 1.0)
        self.policy.zero_grads()
        self.dummy_passes += 1

    @staticmethod
    def _runs_pass(units: list[Service]) -> bool:
        """Whether serving `units` runs a forward/backward: a pack always does; a lone unit
        when it has scored tokens (TrajectoryKind.serve; a group's close alone runs none)."""
        return len(units) > 1 or (len(units) == 1 and units[0].source is not None
                                  and units[0].source.n_scored > 0)

    def _serve(self, svc: Service) -> None:
        src, g = svc.source, svc.group_id
        if src is not None:
            start, cpu0 = self.now(), time.thread_time()
            span = self.kind.serve(svc)  # its tensors are freed by now: timed too
            # cpu: this thread's CPU time; wall − cpu is time the core or the GIL was elsewhere.
            rec = self.records[src.key]
            rec.start, rec.end, rec.cpu = start, self.now(), time.thread_time() - cpu0
            rec.fold, rec.closes_group = svc.fold, svc.closes_group
            rec.open_groups = self.queue.open_groups
            rec.span_tokens, rec.context, rec.logits = (span["span_tokens"], span["context"],
                                                        span["logits"])
            rec.fused_head = rec.logits and self.policy.fused_head
            rec.reference_tokens = self._reference_tokens(src)
            self.trace.append(rec)
            self.scored[g] = self.scored.get(g, 0) + src.n_scored
            self.lag_sums[src.key] = self._lag(src)[0]
            self.open_peak_bytes = max(self.open_peak_bytes, self.open_bytes())
            self.kind.after(svc)  # deferred work (its own trace records, after this one)
            self._check_finite(g, f"{type(src).__name__} {src.key!r} (group {g!r})")
        if svc.last_here:
            self.kind.finish(svc)
            self._check_finite(g, f"the close of group {g!r} (its shared prompt and sum)")

    def _serve_pack(self, pack: list[Service]) -> None:
        """Units of different trajectories in one forward/backward (the gradient is linear
        in their losses, each carrying its own coefficient), folded once — into the batch
        (direct folds), or into their one group's sum (pair folds, `kind.packs_pairs`);
        then each one's deferred work and group finish as if served alone, in order.

        Trace: each source keeps its own span (the pass's FLOPs are the sum of its
        segments'), `pass_id` names the pass, and the pass's wall and CPU time are split
        over its sources in proportion to their span tokens, as consecutive intervals, so
        that busy time (Σ end − start) stays the pass's time."""
        start, cpu0 = self.now(), time.thread_time()
        spans = self.kind.serve_pack(pack)  # its tensors are freed by now: timed too
        end, cpu = self.now(), time.thread_time() - cpu0
        self.passes += 1
        total = sum(s["span_tokens"] for s in spans) or 1
        t = start
        for svc, span in zip(pack, spans):
            src, g = svc.source, svc.group_id
            share = span["span_tokens"] / total
            rec = self.records[src.key]
            rec.start, rec.end, rec.cpu = t, t + (end - start) * share, cpu * share
            t = rec.end
            rec.fold, rec.closes_group = svc.fold, svc.closes_group
            rec.open_groups = self.queue.open_groups
            rec.span_tokens, rec.context, rec.logits = (span["span_tokens"], span["context"],
                                                        span["logits"])
            rec.fused_head = rec.logits and self.policy.fused_head
            rec.reference_tokens = self._reference_tokens(src)
            rec.pass_id = self.passes
            self.trace.append(rec)
            self.scored[g] = self.scored.get(g, 0) + src.n_scored
            self.lag_sums[src.key] = self._lag(src)[0]
        self.open_peak_bytes = max(self.open_peak_bytes, self.open_bytes())
        for svc in pack:
            src, g = svc.source, svc.group_id
            self.kind.after(svc)
            self._check_finite(g, f"{type(src).__name__} {src.key!r} (group {g!r}, packed "
                                  f"pass {self.passes})")
            if svc.last_here:
                self.kind.finish(svc)
                self._check_finite(g, f"the close of group {g!r} (its shared prompt and sum)")

    def _reference_tokens(self, src) -> int:
        """What the reference forwarded for a served source: all of it, when it scores."""
        return len(src.tokens) if self.reference is not None and src.n_scored else 0

    def _check_finite(self, g: str, what: str) -> None:
        """learner.check_finite=source: name the first unit after which the sums this rank
        holds are not finite (checking once per source costs one pass over them)."""
        if self.cfg.check_finite == "source":
            self.flush_grads()
        if self.cfg.check_finite == "source" and not self.nonfinite \
                and not self.policy.sums_finite(self.acc.holding(g)):
            self.nonfinite.append(what)

    # --- what the serving parts call back -------------------------------------------------

    def fold_direct(self, g: str | list[str], grads: list[torch.Tensor], coef: float) -> None:
        """batch += coef·grads: once there, the group (every group of a packed pass) cannot
        be taken out of the update."""
        if self.unfolded:  # the buffers also hold gradient of coefficient 1 (fold_later)
            assert coef == 1.0, "fold_direct with a coefficient over unfolded gradient"
            self.unfolded = False  # folded now with the rest; the caller zeroes the buffers
        self.acc.fold_direct(grads, coef)
        self.committed.update([g] if isinstance(g, str) else g)

    def fold_later(self, g: str | list[str]) -> None:
        """batch += the grad buffers, left in them: the next backward of coefficient 1 (the
        next direct pass, a group's shared prompt) adds to them and one fold takes the sum
        (sync: one fold per update instead of one per pass and per group). Whatever needs
        clean buffers calls `flush_grads` before its backward: a lone source's fold with its
        own coefficient and a pair pass (TrajectoryKind, the only kind that folds later), a
        per-source finite check, an EP dummy pass, the step. FP64 accumulators fold each
        backward as it comes."""
        self.committed.update([g] if isinstance(g, str) else g)
        if self.acc.dtype != self.policy.grad_buffers()[0].dtype:
            self.flush_grads(force=True)
            return
        self.unfolded = True

    def flush_grads(self, force: bool = False) -> None:
        """Fold what `fold_later` left in the grad buffers into the batch; zero them."""
        if self.unfolded or force:
            self.acc.fold_direct(self.policy.grad_buffers(), 1.0)
            self.policy.zero_grads()
            self.unfolded = False

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
        self._kl += kl
        self._kl_tokens += logp.numel()
        return f32(weight) * r

    def defer(self, rec: DeferredRecord) -> None:
        self.trace.append(rec)

    def saw_kv(self, kv: list[KV], n_tokens: int) -> None:
        if n_tokens and not self.kv_per_token:
            self.kv_per_token = kv_bytes(kv) // n_tokens

    def now(self) -> float:
        return time.perf_counter() - self.t0

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
        if self.plan is None:
            raise RuntimeError("drop_group() before begin(): no batch is open")
        if group_id not in self.plan.groups:
            raise SourceError(f"drop of group {group_id!r}: not registered in this batch")
        if group_id in self.dropped:
            return group_id not in self.committed
        self.dropped[group_id] = reason
        self.queue.drop(group_id)
        self.kind.drop(group_id)
        self.routes.drop(self.plan.groups[group_id])
        self.acc.discard_group(group_id)
        self.scored.pop(group_id, None)
        return group_id not in self.committed

    def reject(self, src, reason: str) -> list[str]:
        """The live path's answer to a source `submit` refused: record it, and drop the
        group that registered its trajectory unless a valid copy of it arrived already
        (a duplicate leaves the first copy standing). Returns the groups dropped."""
        key = str(getattr(src, "key", "?"))
        g = None if key in self.arrived else self.member_of.get(getattr(src, "traj_id", None))
        return self._reject(key, reason, g)

    def reject_rewards(self, group_id: str, reason: str) -> list[str]:
        """The live path's answer to a refused GroupRewards: its group cannot be trusted."""
        g = group_id if self.plan is not None and group_id in self.plan.groups else None
        return self._reject(f"rewards of {group_id}", reason, g)

    def _reject(self, what: str, reason: str, g: str | None) -> list[str]:
        self.rejected.append((what, reason))
        if g is None or g in self.dropped:
            return []
        self.drop_group(g, f"{what}: {reason}")
        return [g]

    # --- barrier and step -----------------------------------------------------------------

    def close(self, export_grad: bool = False) -> UpdateResult:
        if self.plan is None:
            raise RuntimeError("close() before begin(): no batch is open")
        groups = list(self.plan.groups)
        # Every rank must agree before the collective step: what was dropped anywhere, what
        # cannot be taken out anywhere, and then what is still missing.
        n = len(groups)
        flags = self.policy.dp_sum_vector(
            [float(g in self.dropped) for g in groups]
            + [float(g in self.committed) for g in groups]
            + [float(self.dropped.get(g) == FILTERED) for g in groups])
        dropped_anywhere = [g for g, d in zip(groups, flags) if d]
        late = [g for g, d, c in zip(groups, flags, flags[n:2 * n]) if d and c]
        if late:
            raise SourceError(f"batch for policy version {self.version}: groups {late} were "
                              f"dropped after their gradient reached the batch on some rank; "
                              f"the update cannot leave them out exactly")
        filtered = {g for g, f in zip(groups, flags[2 * n:]) if f}
        for g in dropped_anywhere:
            self.drop_group(g, self.dropped.get(g, FILTERED if g in filtered
                                                else "dropped on another rank"))
        problems = self._incomplete()
        n_bad = int(self.policy.dp_sum(len(problems)))
        if n_bad:
            raise SourceError(f"batch for policy version {self.version} closed incomplete "
                              f"({n_bad} problems over all ranks); on this rank: {problems}")
        self.queue.close()
        self._drain()
        self.flush_grads()
        assert self.queue.pending() == 0 and not self.acc.open, "batch closed with work left"

        scored = int(self.policy.dp_sum(sum(self.scored.values())))
        first = groups if self.mb is None else self.mb.parts[0]  # what the queue served
        kept = [g for g in first if g not in dropped_anywhere]
        n_groups = len(kept)
        n_trajectories = sum(len(self.plan.groups[g]) for g in kept)
        scale = self.norm.batch_scale(n_groups, n_trajectories, scored,
                                      self.cfg.token_norm_constant)
        # The accumulator holds the descent direction −Σ_G g_G; one step per batch (per
        # mini-batch with learner.minibatches > 1: the later ones follow here).
        if self.mb is not None:
            self.mb.prepare()  # θ_k's log-probs of what is still without them (sync)
        step = self.policy.apply_and_step(self.acc.batch, scale, export_grad=export_grad,
                                          schedule_step=self.mb is None)
        steps, self.minibatch_tokens = [step], []
        if self.mb is not None and step.ok:
            steps += self.mb.run(export_grad, set(dropped_anywhere))
            n_groups = len(groups) - len(dropped_anywhere)
            scored += sum(self.minibatch_tokens)
        last = steps[-1]
        lag = self._lag_figures(dropped_anywhere, scored)
        reg = self._regularizer_figures(dropped_anywhere)
        ppo = self.mb.figures() if self.mb is not None else {}
        summary = UpdateRecord(
            update=self.version, rank=self.policy.par.rank, objective=self.cfg.objective,
            schedule=self.schedule, n_groups=n_groups,
            n_sources=sum(1 for r in self.records.values() if r.served), scored_tokens=scored,
            dropped_groups={g: self.dropped[g] for g in dropped_anywhere},
            rejected_sources=list(self.rejected), open_bound=self.open_bound,
            accum_peak_bytes=self.acc.peak_bytes, accum_bound_bytes=self.acc.bound_bytes,
            accum_params=self.acc.numel,
            open_peak_bytes=self.open_peak_bytes,
            kv_peak_bytes=self.kind.kv_peak_bytes,
            head_peak_bytes=self.policy.take_head_peak(), grad_norm=last.grad_norm,
            lr=last.lr, ok=all(s.ok for s in steps), nonfinite_sources=list(self.nonfinite),
            dummy_passes=self.dummy_passes, minibatch_steps=sum(s.ok for s in steps),
            **lag, **reg, **ppo)
        self.trace.append(summary)
        result = UpdateResult(summary=summary, grad=step.grad, trace=self.trace,
                              minibatch_grads=[s.grad for s in steps],
                              minibatch_params=self.mb.params if self.mb is not None else [])
        if step.ok:  # a skipped step leaves θ_k, so the next batch is again for version k
            self.version += 1  # (mini-batch 1's step applied: θ moved, later ones or not)
            if self.reference is not None:
                self.reference.refresh(self.version)
        self.plan = None
        return result

    def _lag_figures(self, dropped: list[str], scored: int) -> dict:
        """The policy-lag distribution of the scored tokens that trained, and the mismatch
        of every scored token served with a behaviour log-prob, over all DP ranks (TP ranks
        of a DP rank hold the same): one sum and one max all-reduce, one host read of the
        device sums (objectives/off_policy.py)."""
        trained = {k: r for k, r in self.records.items()
                   if r.served and r.group_id not in dropped}
        sums, maxima, tokens = self.off_policy.take()
        lag_sum = sum(self.lag_sums[k] for k in trained)
        trained = trained.values()
        lagged = sum(r.lagged_tokens for r in trained)
        lag_max = max((r.policy_lag for r in trained if r.scored_tokens), default=0)
        s = self.policy.dp_sum_vector([lag_sum, lagged, tokens, *sums])
        mx = self.policy.dp_max_vector([lag_max, *maxima])
        return dict(policy_lag_mean=s[0] / scored if scored else 0.0, policy_lag_max=int(mx[0]),
                    lagged_token_share=s[1] / scored if scored else 0.0,
                    **mismatch(s[3:], mx[1:], int(s[2])).means())

    def _regularizer_figures(self, dropped: list[str]) -> dict:
        """The KL estimator's mean over the scored tokens served with it (over DP ranks),
        the reference's bytes on this rank. A group dropped after some of its members ran
        still counts their tokens here (what was computed, not what trained)."""
        if not self.reg.active:
            return {}
        s = self.policy.dp_sum_vector([float(self._kl), float(self._kl_tokens)])
        out = dict(kl_mean=s[0] / s[1] if s[1] and self.reg.kl_coef else None)
        if self.reference is not None:
            out["reference_bytes"] = self.reference.nbytes
        return out

    def _incomplete(self) -> list[str]:
        """What keeps this batch from closing, as seen from this rank (a collective)."""
        if self.routing == "static":
            return [f"{k} missing" for k in self._missing()]
        # Balanced: every trajectory served on exactly one DP rank, and every group with
        # members here complete (its other members' rewards announced).
        order = [t for g, ts in self.plan.groups.items() if g not in self.dropped for t in ts]
        here = {s.traj_id for s in self.arrived.values()}  # a segmented one's segments: once
        mine = [1.0 if t in here else 0.0 for t in order]
        counts = self.policy.dp_sum_vector(mine)
        problems = [f"{t} arrived on {int(n)} DP ranks" for t, n, m in zip(order, counts, mine)
                    if n != 1 and (m or self.policy.par.dp_rank == 0)]
        return problems + [f"group {g}: rewards of its members on other ranks never announced"
                           for g in self._unannounced()]

    def waiting_for(self) -> list[str]:
        """What this rank still waits for: units of its groups (static routing) or the
        rewards of groups it serves part of (balanced)."""
        if self.plan is None:
            return []
        if self.routing == "balanced":
            return [f"rewards of group {g}" for g in self._unannounced()]
        return self._missing()

    def _missing(self) -> list[str]:
        """Static routing: registered units of this rank's groups not arrived yet."""
        me = self.policy.par.dp_rank
        return [k for g, ts in self.plan.groups.items()
                if self.owner[g] == me and g not in self.dropped
                for t in ts for k in self.kind.unit_keys(t) if k not in self.arrived]

    def _unannounced(self) -> list[str]:
        """Balanced routing: groups served partly here whose rewards are not all known."""
        here = {r.group_id for r in self.records.values()}  # groups with units given here
        return [g for g in here if g not in self.dropped and not self._complete(g)]

    def _complete(self, g: str) -> bool:
        """Every reward of group `g` known here (a later PPO mini-batch's group never
        enters the queue)."""
        if self.mb is not None and g in self.mb.later:
            return self.kind.complete(g)
        return self.queue.is_complete(g)

    def abort(self) -> None:
        """Drop the open batch without touching θ (e.g. after a rejected close)."""
        self.acc.reset()
        self.policy.zero_grads()
        self.unfolded = False
        if self.plan is not None:
            self.kind.begin()  # frees every context and prompt
            self.routes.begin()
        self.plan = None
