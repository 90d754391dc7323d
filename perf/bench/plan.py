"""The order of a cell's updates: calibration, warm-up and paired rounds of every schedule
(`plan_steps`); an asynchronous schedule plays a segment of consecutive updates."""

from __future__ import annotations

from dataclasses import dataclass

from tsync_mcore.config import LearnerConfig
from tsync_mcore.learner.schedule import ASYNC_SCHEDULES, SYNC_SCHEDULES

SCHEDULES = SYNC_SCHEDULES + ASYNC_SCHEDULES
PACK_DEFAULT = LearnerConfig.max_tokens_per_pass  # the learner's default token budget per pass
SEGMENT = 4  # updates an asynchronous schedule plays per round (a pipeline needs several)
STEADY_FROM = 2  # of those, the first ones fill the pipeline and are not measured


@dataclass(frozen=True)
class Step:
    """One update the simulator plays: which batch (draw) and how."""

    draw: int
    schedule: str
    calibration: bool = False  # every source ready at once (R = 0), to measure L(draw)
    warmup: bool = False  # played, not measured
    seg: int = 0  # asynchronous schedules: the update's place in its round's segment
    steady: bool = True  # measured (asynchronous: past the segment's pipeline fill)


def plan_steps(rounds: int, warmup: int = 1, schedules: tuple[str, ...] = SCHEDULES,
               segment: int = SEGMENT, steady_from: int = STEADY_FROM) -> list[Step]:
    """`warmup` rounds (draws -1, -2, …; not measured), then `rounds` rounds (draws 0, 1, …).
    A round is a calibration update of its draw (every source ready at once), then every
    schedule on that draw in an order rotated per round. A synchronous schedule plays one
    update; an asynchronous one a segment of `segment` consecutive updates of the same
    draw, of which those from `steady_from` on are its steady state (the first ones fill
    the pipeline). Calibration sits next to the updates it sets R for: the machine drifts
    over a run. A warm-up round runs every schedule once, so each one's first update in the
    process (cold code paths, the first G1'/G2 pairs allocated) is not measured."""
    if "sync" not in schedules:
        raise ValueError("the schedules compared must include sync (speedups are over it)")
    if not 0 <= steady_from < segment:
        raise ValueError(f"steady_from must be in [0, segment), got {steady_from}/{segment}")

    def play(draw: int, schedule: str, warm: bool) -> list[Step]:
        if schedule not in ASYNC_SCHEDULES:
            return [Step(draw=draw, schedule=schedule, warmup=warm)]
        return [Step(draw=draw, schedule=schedule, warmup=warm, seg=i, steady=i >= steady_from)
                for i in range(segment)]

    steps = []
    n = len(schedules)
    for i in range(warmup):
        steps += [Step(draw=-1 - i, schedule="sync", calibration=True)]
        for s in schedules:
            steps += play(-1 - i, s, True)
    for d in range(rounds):
        order = schedules[d % n:] + schedules[:d % n]
        steps += [Step(draw=d, schedule="sync", calibration=True)]
        for s in order:
            steps += play(d, s, False)
    return steps


def segment_at(steps: list[Step], v: int) -> list[Step]:
    """The asynchronous segment starting at steps[v]."""
    seg = [steps[v]]
    while v + len(seg) < len(steps) and steps[v + len(seg)].seg == len(seg) \
            and steps[v + len(seg)].schedule == steps[v].schedule:
        seg.append(steps[v + len(seg)])
    return seg
