"""When a release unit may be served: release rules, dependencies and admission (docs/design/learner.md).

A release unit is one source: a GRPO trajectory, or one turn of an OPD trajectory (which
depends on its trajectory's previous turn: it runs against that turn's K/V). The three
schedules run the same learner work for every objective and differ only in release time:
  sync         every unit is released when the whole batch closes, and served in the
               registered order (groups as registered, their members, each one's turns);
  group_ready  a group's units are released once the group is *complete*: every unit of
               it that can still be rejected has arrived and every outcome it needs is
               known (GRPO: every member's reward; OPD: every member's every turn);
  thundersync  each unit is released the moment it arrives.
The asynchronous baselines (one_step_off, fully_async) release like thundersync within their
batch; what differs is which policy sampled the batch (a lag of 1, or up to
learner.max_staleness), decided by the rollout and checked at submit.

The queue is work-conserving. Among released units whose dependency is served it prefers,
in order: the next unit of the trajectory served last (its context is warm), units
continuing a started trajectory (earliest released first), then the earliest released unit
that starts one and that admission allows.

Admission: a group is *open* on this rank from the first unit that makes it hold state
(G1'/G2 or its own gradient sum, a shared prompt's K/V, trajectory contexts) until its last
unit here has been served and its deferred work has run. At most `k_open` of the open
groups hold what costs a parameter vector (a pair, a group's own gradient sum: `capped`);
a group that only holds activation-sized state (a complete GRPO group's shared prompt K/V)
is not counted there — the pass it is served in bounds it — so that a packed pass may take
every complete group. With a byte budget a new group is held back while the bytes held by
open groups plus what it would add exceed the budget — unless nothing is open, so the
batch always finishes.
A unit served once its group is complete needs no group sum: its coefficient is known, so
it folds straight into the batch accumulator ("direct"); before that it folds into its
group's own sums ("pair"), which a dropped group discards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol

from tsync_mcore.channel.sources import ASYNC_SCHEDULES, SCHEDULES, SYNC_SCHEDULES, BatchPlan

__all__ = ["ASYNC_SCHEDULES", "SCHEDULES", "SYNC_SCHEDULES"]  # names declared with the wire

Fold = Literal["direct", "pair"]


class Unit(Protocol):
    traj_id: str
    group_id: str

    @property
    def index(self) -> int: ...  # its place among its trajectory's units

    # True: unit i runs against unit i − 1's context (OPD turns), so it waits for it;
    # False: the units are independent sequences (a trajectory's segments)
    chained: bool


@dataclass(frozen=True)
class Service:
    group_id: str
    source: Unit | None  # None: only finish the group (its outcomes became known later)
    fold: Fold  # "direct": coefficient known; "pair": into the group's own sums
    closes_group: bool  # the group was open and is finished after this
    last_here: bool  # nothing more of this group will be served on this rank


class ReadinessQueue:
    """One rank's queue for one batch.

    `opens(unit)`: would serving it make its (not yet open) group hold state?
    `capped(unit)`: would that state count against k_open? (default: yes)
    `fits(unit)`: may a new group open with it under the byte budget? (default: yes)"""

    def __init__(self, schedule: str, plan: BatchPlan, k_open: int,
                 opens: Callable[[Unit], bool] = lambda u: True,
                 fits: Callable[[Unit], bool] = lambda u: True,
                 capped: Callable[[Unit], bool] = lambda u: True):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}")
        self.schedule, self.plan, self.k_open = schedule, plan, k_open
        self._opens, self._fits, self._capped_by = opens, fits, capped
        self._complete: set[str] = set()
        self._open: set[str] = set()
        self._capped: set[str] = set()  # open groups that count against k_open
        self._pending: dict[str, int] = {}  # arrived here, not yet served, per group
        self._held: list[Unit] = []  # arrived, not yet released
        # Released units by (trajectory, index), in release order:
        self._waiting: dict[tuple[str, int], Unit] = {}  # its previous unit not served yet
        self._continuing: dict[tuple[str, int], Unit] = {}  # servable, index > 0
        self._starting: dict[tuple[str, int], Unit] = {}  # servable, a trajectory's first
        self._closable: list[str] = []  # complete, open, nothing of it left to serve
        self._done: dict[str, int] = {}  # trajectory → units served
        self._last: str | None = None  # trajectory served last

    @property
    def open_groups(self) -> int:
        return len(self._open)

    def is_open(self, g: str) -> bool:
        return g in self._open

    def is_complete(self, g: str) -> bool:
        return g in self._complete

    def pending_in(self, g: str) -> int:
        return self._pending.get(g, 0)

    def pending(self) -> int:
        return (len(self._held) + len(self._waiting) + len(self._continuing)
                + len(self._starting) + len(self._closable))

    # --- events ---------------------------------------------------------------------------

    def arrive(self, u: Unit) -> None:
        g = u.group_id
        self._pending[g] = self._pending.get(g, 0) + 1
        if self.schedule in ("thundersync",) + ASYNC_SCHEDULES or (self.schedule == "group_ready"
                                              and g in self._complete):
            self._release(u)
        else:
            self._held.append(u)

    def complete(self, g: str) -> None:
        """Group g is complete here: group_ready releases its units."""
        self._complete.add(g)
        if self.schedule == "group_ready":
            for u in [u for u in self._held if u.group_id == g]:
                self._release(u)
            self._held = [u for u in self._held if u.group_id != g]
        if g in self._open and not self._pending.get(g):
            self._closable.append(g)

    def close(self) -> None:
        """The batch is closed (everything has arrived): release whatever is held."""
        held, self._held = self._held, []
        if self.schedule == "sync":
            rank = {t: i for i, t in enumerate(t for ts in self.plan.groups.values() for t in ts)}
            held.sort(key=lambda u: (rank[u.traj_id], u.index))
        for u in held:
            self._release(u)

    def drop(self, g: str) -> None:
        """Group g does not train: forget its units and its open state."""
        self._held = [u for u in self._held if u.group_id != g]
        for d in (self._waiting, self._continuing, self._starting):
            for k in [k for k, u in d.items() if u.group_id == g]:
                del d[k]
        self._closable = [x for x in self._closable if x != g]
        self._pending.pop(g, None)
        self._shut(g)
        self._complete.discard(g)

    def _release(self, u: Unit) -> None:
        if u.index == 0 or not u.chained:
            self._starting[_at(u)] = u
        elif self._done.get(u.traj_id, 0) == u.index:
            self._continuing[_at(u)] = u
        else:
            self._waiting[_at(u)] = u

    # --- what runs next -------------------------------------------------------------------

    def next(self) -> Service | None:
        """The next piece of work that may run now, or None."""
        if self._closable:
            g = self._closable.pop(0)
            self._shut(g)
            return Service(g, None, "pair", closes_group=True, last_here=True)
        u = self._choose()
        return None if u is None else self._take(u)

    def next_pack(self, budget: int, size: Callable[[Unit], int],
                  packable: Callable[[Unit], bool], may_open: bool = True,
                  pairs: bool = False, may_pair: bool = True) -> list[Service]:
        """The next work as one pass: `next()`, and when that is a direct-fold unit that
        `packable` accepts, more such units — of other trajectories (a unit needs its
        trajectory's previous one served), in the order `next()` would give them — while
        their `size` sums to at most `budget` (the first always runs, however long).
        `pairs=True` (a kind whose pair fold is one plain sum per group, OPD's): a
        pair-fold first unit takes more pair-fold units of its own group, so that the
        pass's one gradient still belongs to one group's sum.
        `may_open=False`: a unit that would open a group joins no pack (a byte budget
        estimates each new group against what open groups hold after a pass).
        `may_pair=False`: no pass of pair folds now (the caller waits to pack them). Empty:
        none."""
        if self._closable:
            return [self.next()]
        u = self._choose()
        if u is None:
            return []
        if pairs and packable(u) and u.group_id not in self._complete:
            u = self._fuller_pass(u, packable)
            if not may_pair and u.group_id not in self._complete:
                return []
        first_capped = u.group_id in self._capped or (
            u.group_id not in self._open and self._opens(u) and self._capped_by(u))
        first = self._take(u)
        if not packable(first.source) or not (first.fold == "direct" or pairs):
            return [first]
        if first.fold == "pair":
            return self._pair_pack(first, budget, size, packable)
        pack, used, trajs = [first], size(first.source), {_chain(first.source)}
        # capped groups closed by a unit of this pass still hold their state until it has run
        closing = {first.group_id} if first.closes_group and first_capped else set()
        for u in list(self._continuing.values()) + list(self._starting.values()):
            if used >= budget:
                break
            if _chain(u) in trajs or u.group_id not in self._complete or not packable(u):
                continue
            opens = u.group_id not in self._open and self._opens(u)
            if opens and not (may_open and self._admissible(u) and (
                    not self._capped_by(u) or len(self._capped) + len(closing) < self.k_open)):
                continue
            n = size(u)
            if used + n > budget:
                continue
            capped = u.group_id in self._capped or (opens and self._capped_by(u))
            pack.append(self._take(u))
            if pack[-1].closes_group and capped:
                closing.add(u.group_id)
            used += n
            trajs.add(_chain(u))
        return pack

    def _fuller_pass(self, u: Unit, packable: Callable[[Unit], bool]) -> Unit:
        """`u` would fold into its incomplete group's sums. If it would run alone there (no
        servable member of its group beside it) while other work could fill a pass, start
        from that work instead: a unit of a complete group (direct folds pack across
        groups), else the first unit of the incomplete group with the most servable units.
        A learner that keeps up still streams every unit as it arrives (it is alone then);
        one that fell behind leaves the lone unit for later, when its group's other
        members, or their rewards, may have arrived and it can share a pass."""
        ready = [v for v in list(self._continuing.values()) + list(self._starting.values())
                 if packable(v) and ((v.index > 0 and v.chained) or self._admissible(v))]
        mates = {}
        for v in ready:
            mates.setdefault(v.group_id, []).append(v)
        if len(mates.get(u.group_id, ())) > 1:
            return u
        direct = [v for v in ready if v.group_id in self._complete]
        if direct:
            return direct[0]
        fullest = max(mates.values(), key=len, default=[u])
        return fullest[0] if len(fullest) > 1 else u

    def _pair_pack(self, first: Service, budget: int, size: Callable[[Unit], int],
                   packable: Callable[[Unit], bool]) -> list[Service]:
        """`first` (pair fold, its group still incomplete and open by now) and more
        servable units of its group, other trajectories, within `budget`."""
        g = first.group_id
        pack, used, trajs = [first], size(first.source), {_chain(first.source)}
        for u in list(self._continuing.values()) + list(self._starting.values()):
            if used >= budget:
                break
            if u.group_id != g or _chain(u) in trajs or not packable(u):
                continue
            n = size(u)
            if used + n > budget:
                continue
            pack.append(self._take(u))  # incomplete group: a pair fold, never a close
            used += n
            trajs.add(_chain(u))
        return pack

    def _take(self, u: Unit) -> Service:
        """Serve `u` now: the queue's bookkeeping, and its Service."""
        g = u.group_id
        if g not in self._open and self._opens(u):
            self._open.add(g)
            if self._capped_by(u):
                self._capped.add(g)
        self._continuing.pop(_at(u), None)
        self._starting.pop(_at(u), None)
        self._pending[g] -= 1
        t = u.traj_id
        self._done[t] = u.index + 1
        self._last = t
        nxt = self._waiting.pop((t, u.index + 1), None)
        if nxt is not None:
            self._continuing[_at(nxt)] = nxt
        complete = g in self._complete
        last = complete and self._pending[g] == 0
        closes = last and g in self._open
        if closes:
            self._shut(g)
        return Service(g, u, "direct" if complete else "pair", closes_group=closes,
                       last_here=last)

    def _choose(self) -> Unit | None:
        if self._last is not None:
            u = self._continuing.get((self._last, self._done.get(self._last, 0)))
            if u is not None:
                return u
        if self._continuing:
            return next(iter(self._continuing.values()))
        # Earliest released first: an older trajectory is nearer its end, so it holds its
        # context for less time (preferring an open group's younger members kept more open).
        return next((u for u in self._starting.values() if self._admissible(u)), None)

    def _admissible(self, u: Unit) -> bool:
        if u.group_id in self._open or not self._opens(u):
            return True
        return ((not self._capped_by(u) or len(self._capped) < self.k_open)
                and (not self._open or self._fits(u)))

    def _shut(self, g: str) -> None:
        self._open.discard(g)
        self._capped.discard(g)


def _at(u: Unit) -> tuple[str, int]:
    return u.traj_id, u.index


def _chain(u: Unit) -> tuple[str, int]:
    """What a pass may hold once: a chained unit's trajectory (its next unit needs it
    served first), or an independent unit itself (a trajectory's segments pack together)."""
    return (u.traj_id, -1) if u.chained else _at(u)
