"""Packed serving (docs/design/learner.md, "Packed serving").

1. `model/packed.py`: a packed forward of several segments (some with past K/V) against
   separate `span_forward` calls, FP64: logits, K/V, parameter gradients and the adjoints on
   the past leaves, for every attention path that runs on CPU.
2. The learner: packed vs one-by-one service gives the same update (FP32 ≤ 1e-6) for GRPO
   (with and without shared prompts) and OPD under every schedule; what packs and what
   stays one by one; the budget's edge cases; the trace's pass ids and times.
"""

from __future__ import annotations

import pytest
import torch

from tsync_mcore.channel.sources import BatchPlan, TrajectorySource
from tsync_mcore.model import bridge
from tsync_mcore.model.packed import (Segment, batch_layout, block_mask, lm_head,
                                       packed_forward)
from tsync_mcore.model.span import KV, detached_leaves, span_forward

FP64 = 1e-12


def _params_grad(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _segments(vocab: int, model, gen) -> list[tuple[torch.Tensor, int, list[KV] | None]]:
    """(tokens, offset, past K/V or None): segments without and with context, one token long,
    and two more after the last one's past (the same object: a group's shared prompt)."""
    out = []
    for n, p in ((7, 0), (9, 5), (4, 0), (1, 3), (6, 11)):
        toks = torch.randint(0, vocab, (n,), generator=gen)
        past = None
        if p:
            with torch.no_grad():
                ctx = torch.randint(0, vocab, (p,), generator=gen)
                _, past = span_forward(model, ctx, 0, None, want_logits=False)
        out.append((toks, p, past))
    for n in (3, 5):
        out.append((torch.randint(0, vocab, (n,), generator=gen), 11, out[-1][2]))
    return out


def _leaves(past, made: dict):
    """Detached leaves of `past`, one set per past object (shared pasts stay shared)."""
    if past is None:
        return None
    return made.setdefault(id(past), detached_leaves(past))


@pytest.mark.parametrize("name,attention,path", [
    ("qwen2", "megatron", "segments"), ("qwen2", "megatron", "block"),
    ("qwen2", "megatron", "batched"), ("qwen2", "sdpa", "segments"), ("qwen2", "sdpa", "block"),
    ("qwen2", "sdpa", "batched"), ("qwen2", "sdpa", "auto"), ("qwen3", "megatron", "segments"),
    ("qwen3", "sdpa", "batched"), ("qwen2_tied", "megatron", "block")])
def test_packed_forward_equals_separate_spans_fp64(parallel1, tiny_ckpts, name, attention, path):
    model, spec = bridge.build_model(tiny_ckpts[name], dtype=torch.float64, attention=attention)
    gen = torch.Generator().manual_seed(3)
    segs = _segments(spec.vocab_size, model, gen)
    coefs = [torch.randn(len(t), spec.vocab_size, generator=gen, dtype=torch.float64)
             for t, _, _ in segs]

    # One by one: span_forward per segment, each loss backpropagated on its own.
    ref_logits, ref_kv, ref_leaves = [], [], {}
    model.zero_grad(set_to_none=True)
    for (toks, p, past), c in zip(segs, coefs):
        leaves = _leaves(past, ref_leaves)
        logits, kv = span_forward(model, toks, p, leaves)
        kv_coef = sum((x.k * 0.1 + x.v * 0.2).sum() for x in kv)  # K/V feed later spans
        ((logits * c).sum() + kv_coef).backward()
        ref_logits.append(logits.detach())
        ref_kv.append([KV(x.k.detach(), x.v.detach()) for x in kv])
    ref_adj = [None if past is None else [(x.k.grad, x.v.grad) for x in ref_leaves[id(past)]]
               for _, _, past in segs]  # a shared past's adjoint sums its segments'
    ref_grad = _params_grad(model)

    # Packed: one forward, one backward of the summed losses.
    made: dict = {}
    leaves = [_leaves(past, made) for _, _, past in segs]
    out = packed_forward(model, [Segment(t, p, lv) for (t, p, _), lv in zip(segs, leaves)],
                         attention=path)
    logits = lm_head(model, out.hidden)
    loss = 0
    for i, c in enumerate(coefs):
        loss = loss + (logits[out.rows(i)] * c).sum()
        loss = loss + sum((x.k * 0.1 + x.v * 0.2).sum() for x in out.kv[i])
    loss.backward()
    grad = _params_grad(model)

    for i in range(len(segs)):
        assert (logits[out.rows(i)] - ref_logits[i]).abs().max() <= FP64, i
        for a, b in zip(out.kv[i], ref_kv[i]):
            assert a.k.shape == b.k.shape and a.k.requires_grad
            assert (a.k - b.k).abs().max() <= FP64 and (a.v - b.v).abs().max() <= FP64, i
        if leaves[i] is not None:
            for x, (gk, gv) in zip(leaves[i], ref_adj[i]):
                assert (x.k.grad - gk).abs().max() <= FP64 and (x.v.grad - gv).abs().max() <= FP64
    assert set(grad) == set(ref_grad)
    for n in grad:
        scale = max(1.0, ref_grad[n].abs().max().item())
        assert (grad[n] - ref_grad[n]).abs().max() <= FP64 * scale, n


def test_stop_after_kv_and_errors(parallel1, tiny_qwen2):
    model, spec = bridge.build_model(tiny_qwen2, dtype=torch.float64)
    a, b = torch.arange(5), torch.arange(5, 12)
    out = packed_forward(model, [Segment(a, 0), Segment(b, 0)], stop_after_kv=True)
    assert out.hidden is None and [len(kv[0]) for kv in out.kv] == [5, 7]
    _, kv_b = span_forward(model, b, 0, None, stop_after_kv=True)
    assert all(torch.equal(x.k, y.k) for x, y in zip(out.kv[1], kv_b)) or \
        max((x.k - y.k).abs().max().item() for x, y in zip(out.kv[1], kv_b)) <= FP64
    with pytest.raises(ValueError, match="segment 1: past is None but offset is 3"):
        packed_forward(model, [Segment(a, 0), Segment(b, 3)])
    with pytest.raises(ValueError, match="segment 0: tokens must be a non-empty"):
        packed_forward(model, [Segment(a[:0], 0)])
    with pytest.raises(ValueError, match="'varlen' needs CUDA"):
        packed_forward(model, [Segment(a, 0)], attention="varlen")


def test_batch_layout_shares_a_past_once():
    a, b, c = torch.arange(2), torch.arange(3), torch.arange(1)
    past = [KV(torch.zeros(2, 1, 1, 1), torch.zeros(2, 1, 1, 1))]
    segs = [Segment(a, 0), Segment(b, 2, past), Segment(c, 2, past)]
    lay = batch_layout(segs, [0, 2, 5], [2, 3, 1])
    assert lay.shape == (2, 4, 6) and lay.pasts == [1]
    # row 1's keys: the past (pool rows 6, 7) once, then b's and c's own rows
    assert lay.k_index.view(6, 2)[:, 1].tolist() == [6, 7, 2, 3, 4, 5]
    m = lay.mask[1, 0]  # True = masked; c's query (t = 3) sees the past and itself only
    assert m.tolist() == [[False, False, False, True, True, True],
                          [False, False, False, False, True, True],
                          [False, False, False, False, False, True],
                          [False, False, True, True, True, False]]
    assert lay.mask[0, 0, 2:].tolist() == [[False] + [True] * 5] * 2  # padding: key 0 only
    assert lay.row_slot.tolist() == [0, 2, 1, 3, 5, 7]


def test_block_mask_layout():
    m = block_mask([2, 1], [1, 2])[0, 0]
    # keys: [p1, a0, a1, p2, p2', b0]; True = masked
    assert m.tolist() == [[False, False, True, True, True, True],
                          [False, False, False, True, True, True],
                          [True, True, True, False, False, False]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention needs CUDA")
def test_varlen_path_matches_segments_on_gpu(tiny_qwen2):
    from tsync_mcore.model.parallel import init_parallel
    init_parallel(tp_size=1)
    model, spec = bridge.build_model(tiny_qwen2, dtype=torch.bfloat16, attention="sdpa")
    gen = torch.Generator().manual_seed(5)
    segs = _segments(spec.vocab_size, model, gen)  # on the CPU, then moved over
    model = model.cuda()
    segs = [(t.cuda(), p, None if past is None else [KV(x.k.cuda(), x.v.cuda()) for x in past])
            for t, p, past in segs]
    with torch.no_grad():
        a = packed_forward(model, [Segment(*s) for s in segs], attention="segments")
        b = packed_forward(model, [Segment(*s) for s in segs], attention="varlen")
    assert (a.hidden.float() - b.hidden.float()).abs().max() < 5e-2


def test_next_pack_rules():
    from tsync_mcore.channel.sources import TurnSource
    from tsync_mcore.learner.schedule import ReadinessQueue

    def turn(t, g, j, n=3):
        return TurnSource(t, g, j, n, 4 * j, (1, 2, 3, 4), (0, 1, 1, 1),
                          (None, -1.0, -1.0, -1.0), 0)

    plan = BatchPlan()
    plan.add_group("A", ["a0", "a1"])
    plan.add_group("B", ["b0", "b1"])
    size, yes = (lambda u: 4), (lambda u: True)
    # sync, OPD-like units: each pass takes at most one turn per trajectory, in order;
    # k_open 1 holds B back until A has run, the pass that closes A included
    q = ReadinessQueue("sync", plan, k_open=1)
    for t, g in (("a0", "A"), ("a1", "A"), ("b0", "B"), ("b1", "B")):
        for j in range(3):
            q.arrive(turn(t, g, j))
    q.complete("A"), q.complete("B")
    q.close()
    passes = []
    while (p := q.next_pack(100, size, yes)):
        passes.append([(s.source.traj_id, s.source.turn) for s in p])
    assert all(len({t for t, _ in p}) == len(p) for p in passes)
    assert passes[0] == [("a0", 0), ("a1", 0)]
    assert all(len({t[0] for t, _ in p}) == 1 for p in passes)  # one group per pass
    assert sum(len(p) for p in passes) == 12 and len(passes) == 6
    # the budget: 2 units of 4 tokens; the first always runs, however long
    q = ReadinessQueue("sync", plan, k_open=4)
    for t, g in (("a0", "A"), ("a1", "A"), ("b0", "B"), ("b1", "B")):
        q.arrive(_traj(t, g))
    q.complete("A"), q.complete("B")
    q.close()
    assert len(q.next_pack(8, size, yes)) == 2
    assert len(q.next_pack(3, size, yes)) == 1  # longer than the budget: alone
    assert len(q.next_pack(8, size, lambda u: False)) == 1  # not packable: alone
    # thundersync: a unit of an incomplete group folds into its pair, never packed
    q = ReadinessQueue("thundersync", plan, k_open=4)
    q.arrive(_traj("a0", "A"))
    q.arrive(_traj("b0", "B"))
    p = q.next_pack(100, size, yes)
    assert [(s.source.traj_id, s.fold) for s in p] == [("a0", "pair")]
    q.arrive(_traj("b1", "B"))
    q.complete("B")  # B's members are now direct: they share a pass
    q.arrive(_traj("a1", "A"))
    p = q.next_pack(100, size, yes)
    assert [(s.source.traj_id, s.fold) for s in p] == [("b0", "direct"), ("b1", "direct")]
    assert p[-1].closes_group and p[-1].last_here


def test_k_open_caps_pairs_not_shared_prompts():
    from tsync_mcore.learner.schedule import ReadinessQueue

    plan = BatchPlan()
    for g in "ABC":
        plan.add_group(g, [f"{g}0", f"{g}1"])
    size, yes = (lambda u: 4), (lambda u: True)

    def queue(schedule):  # GRPO with shared prompts: every group opens, pairs are capped
        q = ReadinessQueue(schedule, plan, k_open=1, capped=lambda u: not q.is_complete(u.group_id))
        return q

    # sync: complete groups hold only their prompts, so one pass takes all three
    q = queue("sync")
    for g in "ABC":
        q.arrive(_traj(f"{g}0", g)), q.arrive(_traj(f"{g}1", g))
        q.complete(g)
    q.close()
    p = q.next_pack(100, size, yes)
    assert [s.source.traj_id for s in p] == ["A0", "A1", "B0", "B1", "C0", "C1"]
    assert all(s.fold == "direct" for s in p) and q.next_pack(100, size, yes) == []
    # thundersync: one incomplete group holds a pair; a second waits for it to close,
    # while a complete group's members still pass
    q = queue("thundersync")
    q.arrive(_traj("A0", "A"))
    assert [(s.source.traj_id, s.fold) for s in q.next_pack(100, size, yes)] == [("A0", "pair")]
    q.arrive(_traj("B0", "B"))
    assert q.next_pack(100, size, yes) == [] and q.open_groups == 1
    q.arrive(_traj("C0", "C")), q.arrive(_traj("C1", "C"))
    q.complete("C")
    p = q.next_pack(100, size, yes)
    assert [(s.source.traj_id, s.fold) for s in p] == [("C0", "direct"), ("C1", "direct")]
    q.arrive(_traj("A1", "A"))
    q.complete("A")
    assert [s.source.traj_id for s in q.next_pack(100, size, yes)] == ["A1"]
    assert [(s.source.traj_id, s.fold) for s in q.next_pack(100, size, yes)] == [("B0", "pair")]
    # may_pair=False (the learner's cost model: wait to pack): no pair pass, direct ones run
    q = queue("thundersync")
    q.arrive(_traj("A0", "A"))
    assert q.next_pack(100, size, yes, pairs=True, may_pair=False) == [] and q.pending() == 1
    q.arrive(_traj("C0", "C")), q.arrive(_traj("C1", "C"))
    q.complete("C")
    p = q.next_pack(100, size, yes, pairs=True, may_pair=False)
    assert [(s.source.traj_id, s.fold) for s in p] == [("C0", "direct"), ("C1", "direct")]
    q.arrive(_traj("A1", "A"))
    q.complete("A")  # complete now: its members pack, held or not
    p = q.next_pack(100, size, yes, pairs=True, may_pair=False)
    assert [(s.source.traj_id, s.fold) for s in p] == [("A0", "direct"), ("A1", "direct")]


def _traj(t, g):
    return TrajectorySource(t, g, (1, 2, 3), (0, 1, 1), 1.0, 0)


from tests.helpers.batchgen import action_first, make_batch, make_opd_batch  # noqa: E402
from tests.helpers.packed_shared import VOCAB  # noqa: E402
from tests.helpers.reference import rel_l2  # noqa: E402
from tsync_mcore.channel.sources import BatchPlan, TrajectorySource, opd_turns_from_json  # noqa: E402
from tsync_mcore.observability import trace  # noqa: E402

SCHEDULES = ("sync", "group_ready", "thundersync", "one_step_off", "fully_async")


def _learner(hf_dir, par, version=0, **learner):
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner
    cfg = load_config(None, {"model.hf_dir": hf_dir, "optim.lr": 1e-5,
                             **{f"learner.{k}": v for k, v in learner.items()}})
    return Learner(cfg.learner, Policy(cfg, par=par), policy_version=version)


def _update(learner, sources, chunk: int):
    """Sources handed over `chunk` at a time before the learner serves (a learner behind
    its rollout: what has arrived meanwhile is servable together); one update."""
    learner.begin(BatchPlan.from_sources(sources))
    for i, s in enumerate(sources):
        learner.submit(s, serve=(i + 1) % chunk == 0)
    return learner.close(export_grad=True)


def _grpo(version=0, update=None, seed=2):
    rows = sorted(make_batch(VOCAB, n_groups=4, m=3, version=version, seed=seed),
                  key=lambda r: r["ready_order"])
    return [TrajectorySource.from_json(r) for r in rows]


def _opd(version=0, seed=3, first=False):
    rows = make_opd_batch(VOCAB, n_traj=6, turns=3, version=version, seed=seed)
    rows = action_first(rows) if first else rows
    turns = [t for r in rows for t in opd_turns_from_json(r)]
    return sorted(turns, key=lambda t: t.ready_order)


def _srecs(res):
    return [r for r in res.trace if isinstance(r, trace.SourceRecord) and r.served]


def _spans(res):
    return sorted((r.traj_id, r.turn, r.span_tokens, r.context, r.logits) for r in _srecs(res))


def _check_pass_times(res):
    """A pass's sources hold consecutive slices of its interval, in pack order."""
    by_pass: dict[int, list] = {}
    for r in _srecs(res):
        if r.pass_id is not None:
            by_pass.setdefault(r.pass_id, []).append(r)
    for recs in by_pass.values():
        assert len(recs) > 1
        for a, b in zip(recs, recs[1:]):
            assert a.end == b.start and a.start <= a.end
    return by_pass


def _compare(hf_dir, par, sources, chunk, version=0, **cfg):
    one = _update(_learner(hf_dir, par, version, max_tokens_per_pass=0, **cfg), sources, chunk)
    packed = _update(_learner(hf_dir, par, version, **cfg), sources, chunk)
    err = rel_l2(packed.grad, one.grad)
    assert _spans(packed) == _spans(one)  # the FLOP ledger reads the same spans
    assert all(r.pass_id is None for r in _srecs(one))
    passes = _check_pass_times(packed)
    assert packed.summary.scored_tokens == one.summary.scored_tokens
    return err, passes, one, packed


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_grpo_packed_update_equals_one_by_one(tiny_qwen2, parallel1, schedule, shared_prefix):
    lag = schedule in ("one_step_off", "fully_async")
    srcs = _grpo(version=0)
    err, passes, one, packed = _compare(tiny_qwen2, parallel1, srcs, chunk=5,
                                        version=1 if lag else 0, schedule=schedule,
                                        shared_prefix=shared_prefix)
    print(f"GRPO {schedule} prefix={shared_prefix}: {len(passes)} passes, rel L2 {err:.2e}")
    assert err <= 1e-6
    assert passes, "nothing was packed"
    for recs in passes.values():  # into the batch, or into one incomplete group's sums
        folds = {r.fold for r in recs}
        assert folds in ({"direct"}, {"pair"}), folds
        if folds == {"pair"}:
            assert len({r.group_id for r in recs}) == 1


@pytest.mark.parametrize("accum_dtype", ["fp32", "fp64"])
def test_sync_folds_the_grad_buffers_once_per_update(tiny_qwen2, parallel1, accum_dtype):
    """A direct pass and the shared prompts after it all carry coefficient 1: their gradient
    stays in the grad buffers and one fold takes it (FP32 accumulators); FP64 ones fold each
    backward as it comes. The prompts of the groups the pass closes run as one packed forward
    and one backward. The update equals the one-by-one learner's (per source and prompt)."""
    srcs = _grpo()
    one = _update(_learner(tiny_qwen2, parallel1, schedule="sync", max_tokens_per_pass=0,
                           accum_dtype=accum_dtype), srcs, chunk=len(srcs))
    learner = _learner(tiny_qwen2, parallel1, schedule="sync", accum_dtype=accum_dtype)
    folds = []
    fold = learner.acc.fold_direct
    learner.acc.fold_direct = lambda grads, coef: (folds.append(coef), fold(grads, coef))
    packed = _update(learner, srcs, chunk=len(srcs))
    prompts = [r for r in packed.trace if getattr(r, "work", None) == "prefix"]
    # one pass; the prompts of the groups it closes forwarded together and backpropagated
    # as one (a group whose unscored member is served after the pass closes on its own)
    assert len(_check_pass_times(packed)) == 1 and max(len(r.spans) for r in prompts) >= 2
    contexts = {r.group_id: r.context for r in _srecs(packed) if r.context}
    assert sorted(n for r in prompts for n, _ in r.spans) == sorted(contexts.values())
    assert len(contexts) == 4
    assert folds == ([1.0] if accum_dtype == "fp32" else [1.0] * (1 + len(prompts)))
    assert rel_l2(packed.grad, one.grad) <= 1e-6


@pytest.mark.parametrize("rewards", ["binary", "real"])
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_grpo_pair_packs_equal_one_by_one(tiny_qwen2, parallel1, rewards, shared_prefix):
    """thundersync, members of incomplete groups handed over together: they pack per group.
    Equal rewards (binary, most packs) fold one backward as one member with that reward;
    different rewards run two backward cotangents over the one forward, (r_i − c) into G1'
    and 1 into G2. Both equal one member per pass."""
    rows = sorted(make_batch(VOCAB, n_groups=3, m=4, seed=5), key=lambda r: r["ready_order"])
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    if rewards == "binary":  # the first three members: all 1, all 0, mixed
        for members, rs in zip(groups.values(), ([1, 1, 1, 0], [0, 0, 0, 1], [1, 0, 1, 0])):
            for r, x in zip(members, rs):
                r["reward"] = float(x)
    # each group's first three members arrive together, its last one later
    srcs = [TrajectorySource.from_json(r) for ms in groups.values() for r in ms[:3]]
    srcs += [TrajectorySource.from_json(ms[3]) for ms in groups.values()]
    err, passes, one, packed = _compare(tiny_qwen2, parallel1, srcs, chunk=9,
                                        schedule="thundersync", shared_prefix=shared_prefix)
    reward = {s.traj_id: s.reward for s in srcs}
    pair_packs = [recs for recs in passes.values() if recs[0].fold == "pair"]
    mixed = [p for p in pair_packs if len({reward[r.traj_id] for r in p}) > 1]
    print(f"GRPO pair packs ({rewards}, prefix={shared_prefix}): "
          f"{[len(p) for p in pair_packs]}, {len(mixed)} mixed, rel L2 {err:.2e}")
    assert err <= 1e-6
    # per group its first three, less the last group's member without scored tokens
    assert sorted(len(p) for p in pair_packs) == [2, 3, 3]
    assert all(len({r.group_id for r in p}) == 1 for p in pair_packs)
    # two cotangents where rewards differ (real: the uniform group 0 is one pass of one)
    assert len(mixed) == (1 if rewards == "binary" else 2)


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "fully_async"])  # GRPO only
def test_opd_packed_update_equals_one_by_one(tiny_qwen2, parallel1, schedule):
    lag = schedule in ("one_step_off", "fully_async")
    srcs = _opd(version=0, first=schedule == "group_ready")
    err, passes, one, packed = _compare(tiny_qwen2, parallel1, srcs, chunk=6,
                                        version=1 if lag else 0, schedule=schedule,
                                        objective="opd")
    print(f"OPD {schedule}: {len(passes)} passes, rel L2 {err:.2e}")
    assert err <= 1e-6
    assert passes, "nothing was packed"
    for recs in passes.values():  # two turns of one trajectory never share a pass
        assert len({r.traj_id for r in recs}) == len(recs)
        assert all(r.logits for r in recs)
        # a pass folds into the batch (direct), or into its one group's sum (pair: the
        # group is still incomplete, so it can still be dropped)
        folds = {r.fold for r in recs}
        assert folds in ({"direct"}, {"pair"}), folds
        if folds == {"pair"}:
            assert len({r.group_id for r in recs}) == 1
    if schedule == "thundersync":  # streaming: turns of incomplete groups pack as well
        assert any(r.fold == "pair" for recs in passes.values() for r in recs)


def test_off_policy_weights_per_token_in_a_pack(tiny_qwen2, parallel1):
    """fully_async with TIS: each segment's ρ_t from its own behaviour log-probs."""
    from tests.helpers.off_policy import CAP, _hf, _with_behaviour
    rows = _with_behaviour(_hf(tiny_qwen2), make_batch(VOCAB, n_groups=3, m=3, seed=11), seed=3)
    srcs = [TrajectorySource.from_json(r) for r in sorted(rows, key=lambda r: r["ready_order"])]
    err, passes, one, packed = _compare(tiny_qwen2, parallel1, srcs, chunk=4, version=1,
                                        schedule="fully_async", is_correction="tis", is_cap=CAP)
    assert err <= 1e-6 and passes
    for f in ("is_weight_mean", "is_truncated_share", "logprob_diff_mean"):
        assert getattr(packed.summary, f) == pytest.approx(getattr(one.summary, f), rel=1e-5)
    assert packed.summary.is_truncated_share > 0


def test_budget_edges(tiny_qwen2, parallel1):
    rows = sorted(make_batch(VOCAB, n_groups=4, m=3, seed=2), key=lambda r: r["ready_order"])
    long = next(r for r in rows if r["group_id"].endswith("g2"))
    long["tokens"] = long["tokens"] + [7, 8, 9] * 12  # longer than any two others together
    long["scored_mask"] = long["scored_mask"] + [1, 1, 0] * 12
    srcs = [TrajectorySource.from_json(r) for r in rows]
    lens = {s.traj_id: s.n_tokens for s in srcs if s.n_scored}
    # 0: today's path, one source per forward/backward
    zero = _update(_learner(tiny_qwen2, parallel1, schedule="sync", shared_prefix=False,
                            max_tokens_per_pass=0), srcs, chunk=1)
    assert all(r.pass_id is None for r in _srecs(zero))
    # every source longer than the budget: each runs alone, the same update
    tiny = _update(_learner(tiny_qwen2, parallel1, schedule="sync", shared_prefix=False,
                            max_tokens_per_pass=min(lens.values()) - 1), srcs, chunk=1)
    assert all(r.pass_id is None for r in _srecs(tiny))
    assert rel_l2(tiny.grad, zero.grad) == 0.0  # the one-by-one path itself, bit for bit
    # a budget just below the longest source: it runs alone, the others pack within it
    longest = max(lens, key=lens.get)
    budget = lens[longest] - 1
    mid = _update(_learner(tiny_qwen2, parallel1, schedule="sync", shared_prefix=False,
                           max_tokens_per_pass=budget), srcs, chunk=1)
    passes = _check_pass_times(mid)
    assert passes and rel_l2(mid.grad, zero.grad) <= 1e-6
    for recs in passes.values():
        assert sum(lens[r.traj_id] for r in recs) <= budget
    assert [r.pass_id for r in _srecs(mid) if r.traj_id == longest] == [None]


def test_what_stays_one_by_one(tiny_qwen2, parallel1):
    # OPD with retained graphs: never packed (a pass's graph would be replayed whole)
    srcs = _opd()
    res = _update(_learner(tiny_qwen2, parallel1, schedule="sync", objective="opd",
                           opd_replay="retain"), srcs, chunk=1)
    assert all(r.pass_id is None for r in _srecs(res))
    # thundersync served on arrival: GRPO units fold into their group's pair (no pack) but
    # a group's last member, whose coefficient is then known
    res = _update(_learner(tiny_qwen2, parallel1, schedule="thundersync"), _grpo(), chunk=1)
    assert all(r.pass_id is None for r in _srecs(res))
    # a byte budget: a unit that would open a group joins no pack
    res = _update(_learner(tiny_qwen2, parallel1, schedule="sync", objective="opd",
                           max_open_bytes=1), srcs, chunk=1)
    passes = _check_pass_times(res)
    assert passes
    for recs in passes.values():
        assert len({r.group_id for r in recs}) == 1


def test_config_key(tmp_path):
    from tsync_mcore.config import ConfigError, load_config
    assert load_config(None, {}).learner.max_tokens_per_pass == 16384
    with pytest.raises(ConfigError, match="learner.max_tokens_per_pass.*must be >= 0"):
        load_config(None, {"learner.max_tokens_per_pass": -1})


def test_pair_pass_waits_only_within_its_overhead_of_the_expected_last_arrival():
    from tsync_mcore.learner.pass_cost import PassCost

    def pays(now, end=6.0, overhead=0.5, kind="trajectory", pack_arrivals=True):
        cost = PassCost()
        cost.on, cost.pair_overhead_s, cost.arrivals_end = pack_arrivals, overhead, end
        return cost.pair_pays(now, kind)

    # a pass that overruns the expected end still pays while the overrun is less than
    # the share of the packed pass it takes away
    assert pays(4.0) and pays(5.4)
    assert not pays(5.6)  # within the overhead of the end: wait and pack
    assert pays(6.5)  # the expected end passed unmet (a longer rollout): stream again
    assert pays(5.6, overhead=None) and pays(5.6, end=None)  # nothing measured yet: stream
    assert pays(5.6, kind="turn") and pays(5.6, pack_arrivals=False)


def test_autocast_learner_keeps_fp32_weights_and_lands_near_the_fp32_update(tiny_qwen2,
                                                                           parallel1):
    """model.autocast: bf16 runs the transformer's products in BF16 from the FP32 weights
    (packed passes, shared prompts, the fused LM head in FP32): the weights, grad buffers
    and exported gradient stay FP32, and the gradient is the FP32 learner's up to BF16
    rounding — not equal to it (the products did run in BF16)."""
    from tsync_mcore.config import load_config
    from tsync_mcore.learner.policy import Policy
    from tsync_mcore.learner.update import Learner

    srcs, grads = _grpo(), {}
    for ac in ("none", "bf16"):
        cfg = load_config(None, {"model.hf_dir": tiny_qwen2, "model.attention": "sdpa",
                                 "model.autocast": ac, "optim.lr": 1e-5})
        policy = Policy(cfg, par=parallel1)
        res = _update(Learner(cfg.learner, policy), srcs, chunk=4)
        assert all(p.dtype == torch.float32 for p in policy.model.parameters())
        assert all(b.dtype == torch.float32 for b in policy.grad_buffers())
        grads[ac] = res.grad
    assert all(g.dtype == torch.float32 for g in grads["bf16"].values())
    err = rel_l2(grads["bf16"], grads["none"])
    assert 1e-5 < err < 5e-2, err
