"""Shared-prefix backward for GRPO groups (the ThunderSyncRL paper's appendix I; docs/design/README.md).

The m trajectories of a group share their prompt. The prompt's forward runs once; each
continuation runs against the prompt's K/V held as detached leaves, so its backward gives
the continuation's parameter gradient and a boundary adjoint on the prompt K/V. The
boundary adjoints are summed exactly like G1'/G2 — A1 = Σ (r_i − c)·adj_i, A2 = Σ adj_i
for members folded before the group's rewards were all known, A = Σ coef_i·adj_i for the
rest — and at group close one backward through the prompt with scale·(A1 − mu·A2) + A
adds the prompt's share of g_G.

The prefix is the group's prompt less its last token when the source says how long the
prompt is (`prompt_len`), otherwise the first served member's tokens up to the position
before its first scored token (that position's logits score the first action token, so it
belongs to the continuation). Members that do not start with the same tokens fall back to a plain
full-sequence backward, which is exact too.

Groups that close in the same packed pass (sync, and whatever streaming serves complete)
forward their prompts in one packed pass too (`SharedPrefix.build_many`): their K/V are
views of one graph, so their backwards run as one (`PrefixBatch`) when the last of them
closes — one pass of the prompts' rows through the weights instead of one per group.
"""

from __future__ import annotations

import torch

from tsync_mcore.learner.accumulators import f32
from tsync_mcore.model.packed import Segment
from tsync_mcore.model.span import KV, backward_kv, detached_leaves, kv_bytes
from tsync_mcore.platform import upload
from tsync_mcore.channel.sources import TrajectorySource


def prefix_len(src) -> int:
    """Tokens a source's group prompt shares (0: none). Known prompt: all of it but its
    last token, whose logits may score the first action token, so every member splits at
    the same place; otherwise up to the position before the first scored token."""
    if src.prompt_len is not None:
        return max(0, src.prompt_len - 1)
    return max(0, src.scored_mask.index(1) - 1) if 1 in src.scored_mask else 0


class PrefixBatch:
    """Prompts forwarded in one packed pass: each one's K/V cotangents wait here until the
    last of them closes, then one backward takes them all (the packed graph runs once)."""

    def __init__(self, n: int):
        self.waiting = n
        self.outs: list[KV] = []
        self.adjoints: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lengths: list[int] = []

    def close(self, produced: list[KV] | None = None, adjoint: list | None = None) -> list[int]:
        """One prompt's share (None: nothing to push). Returns the lengths of the prompts
        the joint backward ran through once the last one closed, else []."""
        if adjoint is not None:
            self.outs += produced
            self.adjoints += adjoint
            self.lengths.append(len(produced[0]))
        self.waiting -= 1
        if self.waiting > 0:
            return []
        ran = backward_kv(self.outs, self.adjoints)
        lengths, self.outs, self.adjoints, self.lengths = self.lengths, [], [], []
        return lengths if ran else []


class SharedPrefix:
    def __init__(self, tokens: tuple[int, ...], produced: list[KV], leaves: list[KV],
                 dtype: torch.dtype, batch: PrefixBatch | None = None):
        self.tokens = tokens
        self.dtype = dtype  # the learner's accumulator precision (FP32, or FP64)
        self.produced = produced  # graph-attached prompt K/V, kept until group close
        self.leaves = leaves
        self.a1: list[torch.Tensor] | None = None  # per layer: K and V adjoints, flattened
        self.a2: list[torch.Tensor] | None = None
        self.has_a1 = False  # a folded reward differed from the shift (else A1 = 0 exactly)
        self.ad: list[torch.Tensor] | None = None  # Σ coef_i·adj_i of members with A_i known
        self.owner: str | None = None  # the trajectory it was forwarded for (its MoE routing)
        self.batch = batch  # the prompts forwarded with it, when packed (their backward is one)

    @classmethod
    def build(cls, policy, src: TrajectorySource,
              dtype: torch.dtype = torch.float32) -> "SharedPrefix | None":
        q = prefix_len(src)
        if q < 1:
            return None  # nothing before the first scored token's context to share
        ids = upload(src.tokens[:q], torch.long, policy.device)
        _, produced = policy.span_forward(ids, 0, None, want_logits=False)
        if produced[0].k.dtype == torch.float64:
            dtype = torch.float64
        return cls(tuple(src.tokens[:q]), produced, detached_leaves(produced), dtype)

    @classmethod
    def build_many(cls, policy, srcs: list[TrajectorySource],
                   dtype: torch.dtype = torch.float32) -> list["SharedPrefix | None"]:
        """The prompts of `srcs` (one per group) in one packed forward, as `build` each."""
        qs = [prefix_len(s) for s in srcs]
        idx = [i for i, q in enumerate(qs) if q >= 1]
        out: list[SharedPrefix | None] = [None] * len(srcs)
        if len(idx) < 2:
            for i in idx:
                out[i] = cls.build(policy, srcs[i], dtype)
            return out
        segs = [Segment(upload(srcs[i].tokens[:qs[i]], torch.long, policy.device), 0)
                for i in idx]
        kv = policy.packed_kv(segs)
        if kv[0][0].k.dtype == torch.float64:
            dtype = torch.float64
        batch = PrefixBatch(len(idx))
        for i, produced in zip(idx, kv):
            out[i] = cls(tuple(srcs[i].tokens[:qs[i]]), produced, detached_leaves(produced),
                         dtype, batch)
        return out

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """What it holds, as the learner's memory accounting counts it: K/V + one adjoint."""
        return 2 * kv_bytes(self.produced)

    def covers(self, src: TrajectorySource) -> bool:
        q = len(self.tokens)
        return (len(src.tokens) > q and tuple(src.tokens[:q]) == self.tokens
                and not any(src.scored_mask[:q + 1]))

    def forward_continuation(self, policy, src: TrajectorySource, with_entropy: bool = False):
        """log π of the continuation's scored tokens (and their entropies), with the graph
        back to the parameters and the prompt's leaves: a backward of a loss on them adds
        to the grad buffers and leaves the boundary adjoint on the leaves. The prompt has
        no scored token (`covers`), so these are all of the source's scored tokens."""
        q = len(self.tokens)
        ids = upload(src.tokens[q:], torch.long, policy.device)
        pos = policy.positions(src.scored_mask[q:])
        out, _ = policy.span_forward(ids, q, self.leaves)  # logits, or the fused head's input
        return policy.scored_logprob(out, ids, pos, with_entropy=with_entropy)

    def _take_adjoint(self, leaves: list[KV] | None = None) -> list[torch.Tensor]:
        adj = []
        for leaf in self.leaves if leaves is None else leaves:
            for t in (leaf.k, leaf.v):
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                adj.append(g.to(self.dtype))
                t.grad = None
        return adj

    def fold_pair(self, r_minus_c: float) -> None:
        adj = self._take_adjoint()
        if self.a1 is None:
            self.a1 = [torch.zeros_like(a) for a in adj]
            self.a2 = [torch.zeros_like(a) for a in adj]
        self.has_a1 = self.has_a1 or r_minus_c != 0.0
        for a1, a2, a in zip(self.a1, self.a2, adj):
            a1.add_(a, alpha=f32(r_minus_c))
            a2.add_(a)

    def fold_pair_part(self, part: str) -> None:
        """A1 += adj (`part="g1"`: the adjoint already carries each member's r_i − c) or
        A2 += adj (`"g2"`), as GradAccumulators.fold_pair_part does for the parameters."""
        adj = self._take_adjoint()
        if self.a1 is None:
            self.a1 = [torch.zeros_like(a) for a in adj]
            self.a2 = [torch.zeros_like(a) for a in adj]
        self.has_a1 = self.has_a1 or part == "g1"
        for acc, a in zip(self.a1 if part == "g1" else self.a2, adj):
            acc.add_(a)

    def fold_direct(self, coef: float, leaves: list[KV] | None = None) -> None:
        """A += coef·adj, taking (and clearing) the adjoint on `leaves` (default: own)."""
        adj = self._take_adjoint(leaves)
        if self.ad is None:
            self.ad = [torch.zeros_like(a) for a in adj]
        for ad, a in zip(self.ad, adj):
            ad.add_(a, alpha=f32(coef))

    def backward_prefix(self, scale: float, mu: float) -> list[int]:
        """Backward through the prompt with scale·(A1 − mu·A2) + A. Returns the lengths of
        the prompts a backward ran through: [] when nothing ran (nothing to do, or a packed
        prompt's share waits for the last of its batch), every share of its batch when it
        was the last."""
        adjoint = self._prompt_adjoint(scale, mu)
        if self.batch is not None:
            batch, self.batch = self.batch, None
            return batch.close(self.produced, adjoint)
        return [len(self)] if adjoint is not None and backward_kv(self.produced, adjoint) \
            else []

    def release(self) -> None:
        """Leave without a backward (a dropped group): its batch stops waiting for it."""
        if self.batch is not None:
            batch, self.batch = self.batch, None
            batch.close()

    def _prompt_adjoint(self, scale: float, mu: float) -> list | None:
        if self.a1 is None and self.ad is None:
            return None
        if self.ad is None and mu == 0.0 and not self.has_a1:
            return None  # a uniform group served in pairs only: its share is exactly zero
        flat = []
        for j in range(len(self.a1 if self.a1 is not None else self.ad)):
            g = None
            if self.a1 is not None:
                if mu == 0.0 and not self.has_a1:
                    # A uniform group's share is exactly zero, however large its scale
                    # (A1 = 0 times an FP32-overflowing scale would be NaN).
                    g = torch.zeros_like(self.a1[j])
                else:
                    g = (self.a1[j] if mu == 0.0 else self.a1[j] - mu * self.a2[j]) * f32(scale)
            if self.ad is not None:
                g = self.ad[j] if g is None else g + self.ad[j]
            flat.append(g)
        return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
