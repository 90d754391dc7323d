"""FP32 gradient accumulators: one batch accumulator and the sums of open groups.

Each accumulator is a list of flat tensors shaped like Megatron's DDP grad buffers
(`grad_data`), so folding a source is one fused pass per buffer. A group folded before it
is complete holds G2 = Σ H_i and, once a folded reward differs from its shift c, G1' =
Σ (r_i − c) H_i (an objective without group statistics only ever holds G2, its plain sum).
At most `k_open` groups are open, so accumulator memory never exceeds 4·(v·k+1)·P bytes per
rank (P = gradient elements on this rank, v = 2 vectors per group, or 1; one more
with a KL or entropy term). Vectors are pooled
and reused across groups. Placement "host" keeps them in (pinned, on GPU machines) host
memory for large models.

Pairs are not zeroed between groups. A pair's first fold writes G2 instead of adding to it,
and G1' stays unwritten (it stands for zero) while every folded reward equals the shift c,
as the first one does by construction. Per group of m that saves the two zeroing passes and
the first member's G1' traffic: for m = 4, 5 + 5 + 5 + 5 + 4 combine + 2 zero = 26 vectors
of P moved become 2 + 5 + 5 + 3 + 4 = 19 (the learner folds a group's last member straight
into the batch, its advantage being known by then).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import tsync_mcore.kernels as K


_F32_MAX = float(torch.finfo(torch.float32).max)


def f32(x: float) -> float:
    """A float64 coefficient as the FP32 kernels can take it: beyond FP32's range it becomes
    ±inf, so the sums go non-finite and the step guard refuses the update (torch refuses to
    convert such a scalar and would stop the learner mid-stream instead)."""
    return math.copysign(math.inf, x) if abs(x) > _F32_MAX else x


@dataclass
class _Pair:
    g2: list[torch.Tensor]  # Σ H_i, valid once has_g2
    shift: float  # c: the group's first folded reward
    g1: list[torch.Tensor] | None = None  # Σ (r_i − c) H_i, taken from the pool when needed
    has_g1: bool = False  # False: G1' = 0 (buffer holds a previous group's data)
    has_g2: bool = False
    g3: list[torch.Tensor] | None = None  # Σ R_i: the regularisers' sum (coefficient 1)

    @property
    def held(self) -> int:
        return 1 + (self.g1 is not None) + (self.g3 is not None)


class GradAccumulators:
    """`per_group`: vectors a group may hold while open (2: G1'/G2 of an affine advantage;
    1: the plain sum of an objective whose coefficients need no group statistics; one more
    with a KL or entropy term: its sum G3, which joins the batch with coefficient 1)."""

    def __init__(self, like: list[torch.Tensor], k_open: int, placement: str = "device",
                 dtype: torch.dtype = torch.float32, per_group: int = 2):
        self.k_open = k_open
        self.per_group = per_group
        self.dtype = dtype
        self.numel = sum(t.numel() for t in like)
        self._devices = [t.device if placement == "device" else torch.device("cpu") for t in like]
        self._pin = placement == "host" and torch.cuda.is_available()
        self._sizes = [t.numel() for t in like]
        self._free: list[list[torch.Tensor]] = []  # pooled vectors, with stale data
        self.open: dict[str, _Pair] = {}
        self.batch = self._new()
        # groups with gradient in `batch` (or on its way: Learner.fold_later): they can no
        # longer be left out of the update
        self.committed: set[str] = set()
        self.peak_bytes = self.bytes_allocated

    def _new(self) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=self.dtype, device=d, pin_memory=self._pin)
                for n, d in zip(self._sizes, self._devices)]

    def _take(self) -> list[torch.Tensor]:
        return self._free.pop() if self._free else self._new()

    @property
    def vector_bytes(self) -> int:
        return self.numel * torch.finfo(self.dtype).bits // 8

    @property
    def bytes_allocated(self) -> int:
        """Bytes held by the batch accumulator, open groups' vectors and pooled vectors."""
        held = sum(p.held for p in self.open.values())
        return (1 + held + len(self._free)) * self.vector_bytes

    @property
    def bound_bytes(self) -> int:
        return (self.per_group * self.k_open + 1) * self.vector_bytes

    def group_bytes(self, group_id: str) -> int:
        p = self.open.get(group_id)
        return 0 if p is None else p.held * self.vector_bytes

    def _staged(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        # Host placement: bring the device gradient over once per fold.
        return [g if g.device == d else g.to(d, non_blocking=False)
                for g, d in zip(grads, self._devices)]

    def fold_direct(self, grads: list[torch.Tensor], coef: float, groups=()) -> None:
        """batch += coef · H (advantage already known: sync and group_ready), H being the
        gradient of `groups`."""
        for acc, g in zip(self.batch, self._staged(grads)):
            K.axpy_(acc, g, f32(coef))
        self.committed.update(groups)

    def commit(self, groups) -> None:
        """`groups` are in the batch from now on (their gradient waits in the grad buffers
        for the next fold)."""
        self.committed.update(groups)

    def open_group(self, group_id: str, shift: float) -> None:
        """Give a group its accumulator; `shift` is c, its first folded reward."""
        if len(self.open) >= self.k_open:
            raise RuntimeError(
                f"admission cap exceeded: {len(self.open)} groups open, k_open={self.k_open}")
        self.open[group_id] = _Pair(self._take(), shift=float(shift))
        self.peak_bytes = max(self.peak_bytes, self.bytes_allocated)

    def fold_pair(self, group_id: str, grads: list[torch.Tensor], reward: float) -> None:
        """G1' += (r − c)·H and G2 += H for an open group, in one pass per buffer once both
        hold data; before that, writes instead of adds (see the module docstring)."""
        pair = self.open[group_id]
        r = f32(float(reward) - pair.shift)
        if r != 0.0 and pair.g1 is None:
            pair.g1 = self._take()
            self.peak_bytes = max(self.peak_bytes, self.bytes_allocated)
        for j, g in enumerate(self._staged(grads)):
            a2 = pair.g2[j]
            if pair.has_g1 and r != 0.0:
                K.accumulate_g1g2_(pair.g1[j], a2, g, r)
                continue
            if r != 0.0:
                K.axpy_(pair.g1[j], g, r, fresh=True)
            K.axpy_(a2, g, 1.0, fresh=not pair.has_g2)
        pair.has_g1 = pair.has_g1 or r != 0.0
        pair.has_g2 = True

    def fold_pair_part(self, group_id: str, grads: list[torch.Tensor], part: str) -> None:
        """G1' += H (`part="g1"`: H already carries each member's r_i − c, a packed pass's
        first backward) or G2 += H (`"g2"`: its second) for an open group."""
        pair = self.open[group_id]
        if part == "g1":
            if pair.g1 is None:
                pair.g1 = self._take()
                self.peak_bytes = max(self.peak_bytes, self.bytes_allocated)
            vecs, fresh = pair.g1, not pair.has_g1
            pair.has_g1 = True
        elif part == "g2":
            vecs, fresh = pair.g2, not pair.has_g2
            pair.has_g2 = True
        else:
            raise ValueError(f"part {part!r}: 'g1' or 'g2'")
        for acc, g in zip(vecs, self._staged(grads)):
            K.axpy_(acc, g, 1.0, fresh=fresh)

    def fold_aux(self, group_id: str, grads: list[torch.Tensor]) -> None:
        """G3 += H for an open group: the gradient of its members' KL/entropy terms, whose
        coefficients are fixed already, kept apart until the group is known to train."""
        pair = self.open[group_id]
        fresh = pair.g3 is None
        if fresh:
            pair.g3 = self._take()
            self.peak_bytes = max(self.peak_bytes, self.bytes_allocated)
        for acc, g in zip(pair.g3, self._staged(grads)):
            K.axpy_(acc, g, 1.0, fresh=fresh)

    def shift_of(self, group_id: str) -> float:
        return self.open[group_id].shift

    def holding(self, group_id: str) -> list[torch.Tensor]:
        """The vectors that hold data a fold into `group_id` may have reached: the batch
        and, while open, the group's valid sums (pooled vectors keep stale data)."""
        out = list(self.batch)
        p = self.open.get(group_id)
        if p is not None:
            out += (p.g2 if p.has_g2 else []) + (p.g1 if p.has_g1 else []) + (p.g3 or [])
        return out

    def is_open(self, group_id: str) -> bool:
        return group_id in self.open

    def close_group(self, group_id: str, scale: float, mu: float) -> None:
        """batch += scale · (G1' − mu·G2) + G3; the vectors return to the pool as they are."""
        pair = self.open.pop(group_id)
        self.committed.add(group_id)
        if pair.g3 is not None:
            for acc, g3 in zip(self.batch, pair.g3):
                K.axpy_(acc, g3, 1.0)
        if scale == 0.0 or not (pair.has_g1 or mu != 0.0):
            self._release(pair)  # its term is exactly 0: every reward equal to c (G1' = 0)
            return
        for j, acc in enumerate(self.batch):
            if pair.has_g1:
                K.combine_group_(acc, pair.g1[j], pair.g2[j], f32(mu), f32(scale))
            elif pair.has_g2:
                K.axpy_(acc, pair.g2[j], f32(-mu * scale))  # G1' = 0: only −mu·G2 is left
        self._release(pair)

    def discard_group(self, group_id: str) -> None:
        """Drop an open group's sums without touching the batch (the group does not train)."""
        pair = self.open.pop(group_id, None)
        if pair is not None:
            self._release(pair)

    def _release(self, pair: _Pair) -> None:
        self._free.append(pair.g2)
        if pair.g1 is not None:
            self._free.append(pair.g1)
        if pair.g3 is not None:
            self._free.append(pair.g3)

    def reset(self) -> None:
        """Start a new batch (or abandon a failed one): everything back to zero."""
        for gid in list(self.open):
            self._release(self.open.pop(gid))
        for t in self.batch:
            t.zero_()
        self.committed.clear()

    def release_pool(self) -> None:
        self._free.clear()
