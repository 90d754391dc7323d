"""Expert parallelism (model.ep > 1): the update's passes in lockstep over the DP ranks.

Every MoE pass is an all-to-all over the EP group, so DP ranks (EP groups tile them) agree
on each step: while any rank has work, each runs one model pass, a real one or a dummy
(docs/guide/moe.md). Only direct folds run then (static routing, the schedules in
`EP_SCHEDULES`), so each rank's grad buffers go to the batch as they are: the expert
gradient of the peers' tokens lands here, with their coefficients in their losses.
"""

from __future__ import annotations

from tsync_mcore.learner.schedule import Service

# the schedules that serve a source only once its group's rewards are known
EP_SCHEDULES = ("sync", "group_ready")


def check(ep: int, routing: str, schedule: str) -> None:
    """The registration's routing and schedule allow lockstep serving
    (Config's expert-parallel checks say why)."""
    if ep > 1 and routing != "static":
        raise ValueError(f"routing {routing!r} with model.ep {ep}: ranks serving in "
                         f"lockstep must each be handed every source (static)")
    if ep > 1 and schedule not in EP_SCHEDULES:
        raise ValueError(f"schedule {schedule!r} with model.ep {ep}: only "
                         f"{' and '.join(EP_SCHEDULES)} fold every source directly")


def serve_together(ln, closed: bool = True, stopping: bool = False) -> tuple[bool, bool, bool]:
    """One lockstep round over the DP ranks (a collective: every rank calls it the same
    number of times). Each rank serves its next pass, or a dummy pass when a peer runs one
    and it has none. `closed`: this rank has its batch's CloseBatch; `stopping`: this rank
    must stop. Returns (any rank served something, some rank is not closed yet, some rank
    is stopping); a stopping round serves nothing."""
    units = [] if stopping else ln.take_pass()
    mine = 2 if runs_pass(units) else 1 if units else 0
    most, waiting, stop = ln.policy.dp_max_vector([float(mine), float(not closed),
                                                   float(stopping)])
    if stop:
        return False, bool(waiting), True  # the batch is abandoned: units need not run
    ln.run_pass(units)
    if most == 2 and mine < 2:
        dummy_pass(ln)
    return most > 0, bool(waiting), False


def dummy_pass(ln) -> None:
    """A pass with nothing to serve; the gradient the peers' tokens left on this rank's
    experts joins the batch (their coefficients are in their losses)."""
    ln.flush_grads()  # the dummy pass zeroes the dense buffers
    ln.policy.dummy_pass()
    ln.fold_direct([], ln.policy.grad_buffers(), 1.0)
    ln.policy.zero_grads()
    ln.batch.dummy_passes += 1


def runs_pass(units: list[Service]) -> bool:
    """Whether serving `units` runs a forward/backward: a pack always does; a lone unit
    when it has scored tokens (TrajectoryKind.serve; a group's close alone runs none)."""
    return len(units) > 1 or (len(units) == 1 and units[0].source is not None
                              and units[0].source.n_scored > 0)
