"""One update of the streaming learner, top to bottom (SPEC §1–3).

    begin(plan)       register the batch's groups and how sources are routed to DP ranks
    submit(source)    validate → release per schedule → serve: forward, fused scored
                      log-prob, backward into the grad buffers, fold into G1'/G2 (or the
                      batch accumulator once the group's rewards are all known, as they
                      are for the member that completes it), zero buffers;
    group_rewards()   (balanced routing) the rewards of members served on other ranks;
                      a complete group's pair is combined (Eq. 7) once nothing of it is
                      left to serve here, and freed
    close()           every source present somewhere → serve what is left → deferred
                      scalar (1/n_groups or 1/N_k) → reduce → clip → one optimizer step

Schedules differ only in when a source is released (schedule.py); the work is the same.
Nothing touches the parameters before close() has checked the whole batch, so an error at
any point leaves θ and the optimizer intact.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from tsync_mcore.accumulators import GradAccumulators
from tsync_mcore.config import LearnerConfig
from tsync_mcore.objectives import ADVANTAGES
from tsync_mcore.policy import Policy
from tsync_mcore.prefix import SharedPrefix
from tsync_mcore.routing import ROUTINGS
from tsync_mcore.schedule import ReadinessQueue, Service
from tsync_mcore.sources import (BatchPlan, SourceError, TrajectorySource, assign_groups,
                                 check_version, validate_source)
from tsync_mcore.trace import DeferredRecord, Record, SourceRecord, UpdateRecord

ACCUM_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class UpdateResult:
    policy_version: int  # the version the batch was sampled from (θ_k)
    ok: bool
    grad_norm: float
    n_sources: int  # served on this rank
    scored_tokens: int  # over all ranks
    accum_peak_bytes: int
    accum_bound_bytes: int
    grad: dict[str, torch.Tensor] | None
    trace: list[Record] = field(default_factory=list)  # ends with this rank's UpdateRecord
    kv_peak_bytes: int = 0  # OPD: context K/V leaves + adjoints held at once


class Learner:
    def __init__(self, cfg: LearnerConfig, policy: Policy, policy_version: int = 0):
        self.cfg = cfg
        self.policy = policy
        self.version = policy_version
        if cfg.objective not in ADVANTAGES:
            raise ValueError(f"Learner runs {sorted(ADVANTAGES)}; use OPDLearner for {cfg.objective!r}")
        self.objective = ADVANTAGES[cfg.objective]
        self.acc = GradAccumulators(policy.grad_buffers(), cfg.k_open, cfg.accum,
                                    dtype=ACCUM_DTYPES[cfg.accum_dtype])
        self.plan: BatchPlan | None = None

    # --- register -------------------------------------------------------------------------

    def begin(self, plan: BatchPlan, group_tokens: dict[str, int] | None = None,
              schedule: str | None = None, routing: str = "static",
              t0: float | None = None) -> None:
        """`schedule` overrides the configured release schedule for this batch only; `t0`
        (perf_counter, default now) is the origin of the trace's times.

        `routing` says how sources reach the DP ranks (tsync_mcore.routing): "static", each
        group to its `assign_groups` owner (sources of other groups may be submitted too and
        only lend their rewards); "balanced", each trajectory to whichever rank the rollout
        chose, so this rank serves every source it is given and learns the rewards of
        members served elsewhere from `group_rewards`."""
        if self.plan is not None:
            raise RuntimeError(f"batch for policy version {self.version} is still open")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        par = self.policy.par
        self.schedule = schedule or self.cfg.schedule
        self.routing = routing
        self.owner = assign_groups(plan, group_tokens or {}, par.dp_size)
        self.plan = plan
        self.queue = ReadinessQueue(self.schedule, plan, self.cfg.k_open)
        self.member_of = {t: g for g, ts in plan.groups.items() for t in ts}
        self.arrived: dict[str, TrajectorySource] = {}
        self.rewards: dict[str, float] = {}  # every reward known here, served here or not
        self.announced: set[str] = set()  # groups whose rewards came from group_rewards
        self.here: set[str] = set()  # groups with members given to this rank to serve
        self.trace: list[Record] = []
        self.t0 = time.perf_counter() if t0 is None else t0
        self.scored_local = 0
        self.prefixes: dict[str, SharedPrefix | None] = {}
        self.acc.reset()

    # --- stream ---------------------------------------------------------------------------

    def submit(self, src: TrajectorySource, arrived: float | None = None) -> None:
        """Accept a ready source and serve whatever the schedule releases now.

        `arrived`: perf_counter time the source reached this process (default: now), so the
        trace's ready time is not delayed by the learner being busy."""
        self._check(src)
        g = src.group_id
        self.arrived[src.traj_id] = src
        self.rewards[src.traj_id] = float(src.reward)
        if self.routing == "balanced" or self.owner[g] == self.policy.par.dp_rank:
            self.here.add(g)
            self.queue.arrive(src)
            self._note(src, ready=self._now() if arrived is None else arrived - self.t0)
        self._maybe_complete(g)
        self._drain()

    def group_rewards(self, group_id: str, rewards: dict[str, float]) -> None:
        """The rollout's announcement of every reward of a finished group (balanced routing:
        some members were served on other ranks). Checked against what arrived here."""
        if self.plan is None:
            raise RuntimeError("group_rewards() before begin(): no batch is open")
        members = self.plan.groups.get(group_id)
        name = f"rewards of group {group_id!r}"
        if members is None:
            raise SourceError(f"{name}: group is not registered in this batch")
        if group_id in self.announced:
            raise SourceError(f"{name}: duplicate, already announced in this batch")
        if set(rewards) != set(members):
            raise SourceError(f"{name}: announced for {sorted(rewards)}, the group registered "
                              f"{sorted(members)}")
        for t, r in rewards.items():
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
                raise SourceError(f"{name}: reward of {t!r} must be a finite number, got {r!r}")
            if t in self.rewards and self.rewards[t] != float(r):
                raise SourceError(f"{name}: {t!r} arrived with reward {self.rewards[t]!r}, "
                                  f"announced {float(r)!r}")
        self.announced.add(group_id)
        self.rewards.update({t: float(r) for t, r in rewards.items()})
        self._maybe_complete(group_id)
        self._drain()

    def _maybe_complete(self, g: str) -> None:
        if not self.queue.is_complete(g) and all(t in self.rewards for t in self.plan.groups[g]):
            self.queue.complete(g)

    def _check(self, src: TrajectorySource) -> None:
        if self.plan is None:
            raise RuntimeError("submit() before begin(): no batch is open")
        validate_source(src, self.policy.vocab_size)
        name = f"trajectory {src.traj_id!r}"
        check_version(name, src.policy_version, self.version)
        if src.traj_id in self.arrived:
            raise SourceError(f"{name}: duplicate, already received in this batch")
        members = self.plan.groups.get(src.group_id)
        if members is None:
            raise SourceError(f"{name}: group {src.group_id!r} is not registered in this batch")
        if self.member_of.get(src.traj_id) != src.group_id:
            raise SourceError(f"{name}: not one of the {len(members)} trajectories registered for "
                              f"group {src.group_id!r}; the group would be larger than registered")
        if src.traj_id in self.rewards and self.rewards[src.traj_id] != float(src.reward):
            raise SourceError(f"{name}: reward {float(src.reward)!r}, but the group's rewards "
                              f"were announced with {self.rewards[src.traj_id]!r}")

    def _drain(self) -> None:
        while (svc := self.queue.next()) is not None:
            self._serve(svc)

    def _serve(self, svc: Service) -> None:
        src, g = svc.source, svc.group_id
        start = self._now()
        cpu0 = time.thread_time()
        if src is not None and src.n_scored > 0:
            if svc.fold == "pair" and not self.acc.is_open(g):
                self.acc.open_group(g, shift=src.reward)  # c = the group's first folded reward
            # Token weight 1/L_i now; 1/n_groups (or 1/N_k) is the deferred scalar at close.
            w = 1.0 / src.n_scored if self.cfg.token_norm == "trajectory" else 1.0
            prefix = self._prefix_for(src) if self.cfg.shared_prefix else None
            if prefix is None:
                self.policy.backward_source(list(src.tokens), list(src.scored_mask), w)
            else:
                prefix.backward_continuation(self.policy, src, w)
            q = len(prefix) if prefix is not None else 0
            # what ran (FLOP ledger): the span after the prompt, the LM head and the loss
            span = dict(span_tokens=src.n_tokens - q, context=q, logits=True)
            grads = self.policy.grad_buffers()
            if svc.fold == "direct":
                coef = self._direct_coef(src)
                self.acc.fold_direct(grads, coef)
                if prefix is not None:
                    prefix.fold_direct(coef)
            else:
                self.acc.fold_pair(g, grads, src.reward)
                if prefix is not None:
                    prefix.fold_pair(src.reward - self.acc.shift_of(g))
            self.policy.zero_grads()
            self.scored_local += src.n_scored
        scale, mu = 1.0, 0.0
        if svc.closes_group and self.acc.is_open(g):
            scale, mu = self.objective.closure(self._group_rewards(g), self.acc.shift_of(g),
                                               self.cfg.adv_eps)
            self.acc.close_group(g, scale, mu)
        if src is not None:
            # cpu: this thread's CPU time; wall − cpu is time the core or the GIL was elsewhere.
            # Noted before the prompt backward, which is its own trace entry (counted once).
            self._note(src, start=start, end=self._now(), cpu=time.thread_time() - cpu0,
                       fold=svc.fold, closes_group=svc.closes_group,
                       open_groups=self.queue.open_groups,
                       **(span if src.n_scored > 0 else {}))
        if svc.last_here:
            self._close_prefix(g, scale, mu)

    def _direct_coef(self, src: TrajectorySource) -> float:
        i = self.plan.groups[src.group_id].index(src.traj_id)
        return self.objective.source_coef(self._group_rewards(src.group_id), i, self.cfg.adv_eps)

    def _prefix_for(self, src: TrajectorySource) -> SharedPrefix | None:
        """The group's shared prompt, computed once on its first scored source."""
        g = src.group_id
        if g not in self.prefixes:
            self.prefixes[g] = SharedPrefix.build(self.policy, src, dtype=self.acc.dtype)
        prefix = self.prefixes[g]
        return prefix if prefix is not None and prefix.covers(src) else None

    def _close_prefix(self, g: str, scale: float, mu: float) -> None:
        """One backward through the prompt with scale·(A1 − mu·A2) + A, into the batch."""
        prefix = self.prefixes.pop(g, None)
        start, cpu0 = self._now(), time.thread_time()
        ran = prefix is not None and prefix.backward_prefix(scale, mu)
        n = len(prefix) if prefix is not None else 0
        del prefix  # its K/V and graph are freed inside the timing
        if ran:
            self.acc.fold_direct(self.policy.grad_buffers(), 1.0)
            self.policy.zero_grads()
            self.trace.append(DeferredRecord(
                update=self.version, rank=self.policy.par.rank, work="prefix", group_id=g,
                traj_id=None, ready=start, start=start, end=self._now(),
                cpu=time.thread_time() - cpu0, spans=[(n, 0)]))

    def _group_rewards(self, g: str) -> list[float]:
        return [self.rewards[t] for t in self.plan.groups[g]]

    # --- barrier and step -----------------------------------------------------------------

    def close(self, export_grad: bool = False) -> UpdateResult:
        if self.plan is None:
            raise RuntimeError("close() before begin(): no batch is open")
        problems = self._incomplete()
        # Every rank must agree before the collective step: count the problems anywhere.
        n_bad = int(self.policy.dp_sum(len(problems)))
        if n_bad:
            raise SourceError(f"batch for policy version {self.version} closed incomplete "
                              f"({n_bad} problems over all ranks); on this rank: {problems}")
        self.queue.close()
        self._drain()
        assert self.queue.pending() == 0 and not self.acc.open, "batch closed with work left"

        scored = int(self.policy.dp_sum(self.scored_local))
        if self.cfg.token_norm == "trajectory":
            scale = 1.0 / self.plan.n_groups
        else:
            scale = 1.0 / scored if scored else 0.0
        # The accumulator holds the descent direction −Σ_G g_G; one step per batch.
        step = self.policy.apply_and_step(self.acc.batch, scale, export_grad=export_grad)
        served = sum(1 for r in self.trace if isinstance(r, SourceRecord) and r.served)
        self.trace.append(UpdateRecord(
            update=self.version, rank=self.policy.par.rank, objective=self.cfg.objective,
            schedule=self.schedule, n_groups=self.plan.n_groups, n_sources=served,
            scored_tokens=scored, open_bound=f"k_open={self.cfg.k_open}",
            accum_peak_bytes=self.acc.peak_bytes, accum_bound_bytes=self.acc.bound_bytes,
            grad_norm=step.grad_norm, ok=step.ok))
        result = UpdateResult(
            policy_version=self.version, ok=step.ok, grad_norm=step.grad_norm,
            n_sources=served, scored_tokens=scored,
            accum_peak_bytes=self.acc.peak_bytes, accum_bound_bytes=self.acc.bound_bytes,
            grad=step.grad, trace=self.trace)
        self.version += 1
        self.plan = None
        return result

    def _incomplete(self) -> list[str]:
        """What keeps this batch from closing, as seen from this rank (a collective)."""
        if self.routing == "static":
            return [f"{t} missing" for t in self._missing_members()]
        # Balanced: every trajectory served on exactly one DP rank, and every group with
        # members here complete (its other members' rewards announced).
        order = [t for ts in self.plan.groups.values() for t in ts]
        mine = [1.0 if t in self.arrived else 0.0 for t in order]
        counts = self.policy.dp_sum_vector(mine)
        problems = [f"{t} arrived on {int(n)} DP ranks" for t, n, m in zip(order, counts, mine)
                    if n != 1 and (m or self.policy.par.dp_rank == 0)]
        return problems + [f"group {g}: rewards of its members on other ranks never announced"
                           for g in self._unannounced()]

    def waiting_for(self) -> list[str]:
        """What this rank still waits for: members of its groups (static routing) or the
        rewards of groups it serves part of (balanced)."""
        if self.plan is None:
            return []
        if self.routing == "balanced":
            return [f"rewards of group {g}" for g in self._unannounced()]
        return self._missing_members()

    def _missing_members(self) -> list[str]:
        """Static routing: registered members of this rank's groups not arrived yet."""
        me = self.policy.par.dp_rank
        return [t for g, ts in self.plan.groups.items() if self.owner[g] == me
                for t in ts if t not in self.arrived]

    def _unannounced(self) -> list[str]:
        """Balanced routing: groups served partly here whose rewards are not all known."""
        return [g for g in self.here if not self.queue.is_complete(g)]

    def abort(self) -> None:
        """Drop the open batch without touching θ (e.g. after a rejected close)."""
        self.acc.reset()
        self.policy.zero_grads()
        self.prefixes = {}
        self.plan = None

    # --- helpers --------------------------------------------------------------------------

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _note(self, src: TrajectorySource, **fields) -> None:
        if "ready" in fields:
            self.trace.append(SourceRecord(
                update=self.version, rank=self.policy.par.rank, source="trajectory",
                traj_id=src.traj_id, group_id=src.group_id, turn=None,
                policy_version=src.policy_version, scored_tokens=src.n_scored, **fields))
        else:
            rec = next(r for r in reversed(self.trace)
                       if isinstance(r, SourceRecord) and r.traj_id == src.traj_id)
            for k, v in fields.items():
                setattr(rec, k, v)
