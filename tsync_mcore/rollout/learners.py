"""The rollout's links to the learner ranks: what it sends about a batch (RegisterBatch,
sources routed to their ranks, group rewards, DropGroup, CloseBatch) and what it takes from
them between sends (Rejected, Shutdown, and under the asynchronous schedules, Publish).

A source that fails the learner's checks here, or that a learner rank rejects, drops its
group: DropGroup → every rank, once, and nothing more of the group is sent."""

from __future__ import annotations

import time

from tsync_mcore.channel import (ChannelError, CloseBatch, DropGroup, GroupRewards, Link,
                                 Publish, RegisterBatch, Rejected, Shutdown, TrajectoryMsg)
from tsync_mcore.channel.routing import BalancedRouter
from tsync_mcore.channel.sources import (BatchPlan, SourceError, TrajectorySource, TurnSource,
                                         assign_groups, validate_source, validate_turn)
from tsync_mcore.config import Config
from tsync_mcore.publication.receive import FINISHED, RolloutStopped


class LearnerFinished(Exception):
    """The learner said it finished (run.updates or run.budget_s): stop wherever we are."""


class LearnerLinks:
    """One link per learner rank (rank r: DP rank r // tp), the groups dropped from the
    open batch, and the publications taken mid-batch, not yet loaded (`notices`)."""

    def __init__(self, links: list[Link], cfg: Config, vocab_size: int, max_tokens: int):
        self.links = links
        self.objective = cfg.learner.objective
        self.routing = cfg.routing
        self.tp = cfg.model.tp
        self.dp = cfg.rollout.n_learners // cfg.model.tp
        self.timeout_s = cfg.channel.timeout_s
        # a Publish mid-batch is expected only when sampling runs ahead of the learner
        self.takes_publish = cfg.learner.schedule in ("one_step_off", "fully_async")
        self.vocab_size, self.max_tokens = vocab_size, max_tokens  # the learner's checks
        self.dropped: dict[str, str] = {}  # the open batch's dropped groups: why
        self.notices: list[Publish] = []

    # --- sending --------------------------------------------------------------------------

    def register(self, version: int, groups: dict[str, list[str]], data_pos: int,
                 n_turns: dict[str, int]) -> None:
        """RegisterBatch of update `version` → every learner rank: its groups, turn counts
        (OPD), the data position after it and the routing. Opens the batch."""
        self.dropped = {}
        msg = RegisterBatch(version=version, objective=self.objective, groups=groups,
                            n_turns=n_turns, data_pos=data_pos, routing=self.routing)
        for link in self.links:
            link.send(msg)

    def close(self, version: int, rollout_time_s: float, n_sources: int,
              reward_mean: float | None, metrics: dict) -> None:
        """CloseBatch of update `version` → every learner rank."""
        msg = CloseBatch(version=version, rollout_time_s=rollout_time_s, n_sources=n_sources,
                         reward_mean=reward_mean, metrics=metrics)
        for link in self.links:
            link.send(msg)

    def ranks_of(self, dp_rank: int) -> list[int]:
        return [dp_rank * self.tp + t for t in range(self.tp)]

    def owners(self, groups: dict[str, list[str]]) -> dict[str, list[int]]:
        """Group → the learner ranks that serve it (all TP ranks of its DP owner)."""
        owner = assign_groups(BatchPlan(groups=groups), {}, self.dp)
        return {g: self.ranks_of(d) for g, d in owner.items()}

    def router(self, groups: dict[str, list[str]]) -> BalancedRouter:
        return BalancedRouter(groups, self.dp)

    def send(self, ranks: list[int], msg) -> None:
        for r in ranks:
            self.links[r].send(msg)

    def drop(self, version: int, gid: str, reason: str, quiet: bool = False) -> None:
        """Group `gid` leaves update `version`: every learner rank is told, once."""
        if gid in self.dropped:
            return
        self.dropped[gid] = reason
        if not quiet:
            print(f"[rollout] dropped group {gid} of update {version}: {reason}", flush=True)
        for link in self.links:
            link.send(DropGroup(version=version, group_id=gid, reason=reason[:2000]))

    def checked(self, version: int, src: TrajectorySource | TurnSource) -> bool:
        """True if the source may be sent; otherwise its group is dropped."""
        if src.group_id in self.dropped:
            return False
        try:
            check = validate_turn if isinstance(src, TurnSource) else validate_source
            check(src, self.vocab_size, self.max_tokens)
        except SourceError as e:
            self.drop(version, src.group_id, str(e))
            return False
        return True

    def send_trajectory(self, version: int, segs: list[TrajectorySource],
                        owners: dict[str, list[int]], router: BalancedRouter) -> None:
        """A finished, checked trajectory of update `version` (its segments, one message
        each, back to back) to the learner ranks: its group's owners (rollout.routing:
        static), or the one rank the balanced router picks for the whole trajectory,
        followed, once its group's last member is in, by the group's rewards to every rank
        holding a member."""
        src = segs[0]
        if self.routing == "static":
            for seg in segs:
                self.send(owners[src.group_id], TrajectoryMsg(seg))
            return
        to = router.route(src.traj_id, src.group_id, src.reward,
                          sum(len(s.tokens) for s in segs))
        for seg in segs:
            self.send(self.ranks_of(to.rank), TrajectoryMsg(seg))
        if to.rewards is not None:  # after its last member's message
            announce = GroupRewards(version=version, group_id=src.group_id, rewards=to.rewards)
            for d in to.announce_to:
                self.send(self.ranks_of(d), announce)

    def shutdown(self, reason: str) -> None:
        """Tell every learner rank why the rollout stops, instead of a bare close."""
        for link in self.links:
            try:
                link.send(Shutdown(reason[:4000]))
            except ChannelError:
                pass

    def close_all(self) -> None:
        for link in self.links:
            link.close()

    # --- receiving ------------------------------------------------------------------------

    def expect(self, rank: int, kind: type):
        """The next message from learner rank `rank`, which must be a `kind`."""
        msg = self.links[rank].recv(timeout_s=self.timeout_s)
        if not isinstance(msg, kind):
            raise RolloutStopped(f"expected {kind.__name__} from learner rank {rank}, "
                                 f"got {type(msg).__name__}")
        return msg

    def take_messages(self, version: int) -> None:
        """Learner ranks say which sources they refused (a check the rollout did not make):
        the group is dropped everywhere. Never waits."""
        for link in self.links:
            while (msg := link.poll()) is not None:
                self.on_message(msg, version)

    def on_message(self, msg, version: int) -> None:
        """A learner's message while update `version` is open (-1: none is): Rejected drops
        its group, Shutdown stops the rollout (LearnerFinished when the learner finished),
        a Publish (asynchronous schedules) waits in `notices`."""
        if isinstance(msg, Rejected):
            if msg.version == version:
                self.drop(version, msg.group_id, f"a learner rejected {msg.source}: {msg.reason}")
            else:  # a closed batch's: the learners agree on it at its close
                print(f"[rollout] learner rejected {msg.source} of update {msg.version}: "
                      f"{msg.reason}", flush=True)
            return
        if isinstance(msg, Shutdown):
            if msg.reason.startswith(FINISHED) or self.learner_finished():
                raise LearnerFinished()
            raise RolloutStopped(f"learner shut down: {msg.reason}")
        if isinstance(msg, Publish) and self.takes_publish:
            self.notices.append(msg)  # loaded between batches (one_step_off) or at once
            return
        raise RolloutStopped(f"unexpected {type(msg).__name__} from a learner mid-batch")

    def learner_finished(self, wait_s: float = 5.0) -> bool:
        """Did the learner finish normally? Rank 0 announces it before any other rank
        closes its link (Trainer._finish_together), so a closed link of another rank waits
        here (bounded) for link 0's reader to have taken that announcement."""
        deadline = time.monotonic() + wait_s
        while not (self.links[0].peer_shutdown or "").startswith(FINISHED):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True
