"""Which experts a MoE policy's forwards route each trajectory position to
(`learner.routing_replay`, docs/guide/moe.md#mixture-of-experts-rollout-and-routing-replay).

Per trajectory the learner keeps a book of expert ids by position, [positions, MoE layers,
top-k], −1 where none is known:

- "rollout": the rows the rollout sent (`routed_experts`, checked against the model when
  the source arrives); a position it did not feed through the model (a trajectory's
  last) routes itself;
- "learner": what the first forward over a position used; a later forward of that
  position (an OPD turn's recompute replay, a span re-run from one position earlier, the
  group prompt's K/V that a turn extends) replays it;
- "off": nothing is kept, every forward routes itself.

Every forward of the serving parts runs inside `forward(spans)`, spans being (trajectory,
first position, tokens) in the order the pass lays its rows out (a packed pass: its
segments'). Sync and streamed updates serve the same positions with the same book, so
they route alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tsync_mcore.model.routing_replay import guided_routing
from tsync_mcore.channel.sources import SourceError, TrajectorySource, check_routing

Span = tuple[str, int, int]  # (its context: trajectory or segment, first position, tokens)


class ExpertRoutes:
    def __init__(self, mode: str, policy):
        spec = policy.spec
        if mode != "off" and not spec.moe:
            raise ValueError(f"learner.routing_replay {mode!r}: the model has no MoE layers")
        self.mode = mode
        self.model, self.device = policy.model, policy.device
        self.layers, self.topk, self.experts = spec.layers, spec.top_k, spec.num_experts
        self.book: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        self.book = {}

    # --- sources --------------------------------------------------------------------------

    def check(self, name: str, src) -> None:
        """"rollout": the source carries routed experts, one row per position it fed
        through the model (SourceError otherwise). Other modes ignore what it carries."""
        if self.mode != "rollout":
            return
        if src.routed_experts is None:
            raise SourceError(f"{name}: no routed_experts, and learner.routing_replay is "
                              f"'rollout'")
        rows = src.n_tokens - 1 if isinstance(src, TrajectorySource) else src.routed_rows
        check_routing(name, src.routed_experts, rows, self.layers, self.topk, self.experts)

    def arrived(self, src) -> None:
        if self.mode == "rollout":
            ids = torch.from_numpy(src.routed_experts.array().astype("int16"))
            self._write(src.context, getattr(src, "start", 0), ids, only_unknown=False)

    def agree(self, a: str | None, b: str, n: int) -> bool:
        """Were positions 0..n−1 of trajectories a and b booked to the same experts (so one
        forward of their shared prompt serves both)? Only "rollout" books them before
        they run; otherwise the prompt's first forward is its record."""
        if self.mode != "rollout" or a == b:
            return True
        return torch.equal(self._read(a, 0, n), self._read(b, 0, n))

    def drop(self, traj_ids) -> None:
        """Forget these trajectories' books (each segment's too)."""
        for t in traj_ids:
            for k in [k for k in self.book if k == t or k.startswith(t + "/")]:
                del self.book[k]

    # --- forwards -------------------------------------------------------------------------

    @contextmanager
    def forward(self, spans: list[Span]) -> Iterator[None]:
        """Run one pass (forward, and its backward where the caller puts it in the block)
        over these spans' rows with the book's experts; "learner" books what it used."""
        if self.mode == "off":
            yield
            return
        given = torch.cat([self._read(t, a, n) for t, a, n in spans])
        with guided_routing(self.model, given.to(self.device)) as used:
            yield
        if self.mode == "learner" and used:
            rows = torch.full_like(given, -1)
            for layer, ids in used.items():
                rows[:, layer] = ids.to(torch.int16).cpu()
            at = 0
            for t, a, n in spans:
                self._write(t, a, rows[at:at + n], only_unknown=True)
                at += n

    def _read(self, traj_id: str, a: int, n: int) -> torch.Tensor:
        out = torch.full((n, self.layers, self.topk), -1, dtype=torch.int16)
        have = self.book.get(traj_id)
        if have is not None and a < len(have):
            got = have[a:a + n]
            out[:len(got)] = got
        return out

    def _write(self, traj_id: str, a: int, rows: torch.Tensor, only_unknown: bool) -> None:
        have = self.book.get(traj_id)
        end = a + len(rows)
        if have is None or len(have) < end:
            grown = torch.full((end, self.layers, self.topk), -1, dtype=torch.int16)
            if have is not None:
                grown[:len(have)] = have
            self.book[traj_id] = have = grown
        if only_unknown:  # first record wins, per position and layer
            mine = have[a:end]
            keep = mine[..., :1] >= 0
            have[a:end] = torch.where(keep, mine, rows)
        else:
            have[a:end] = rows
