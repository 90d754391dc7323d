"""Segmented trajectories: a trajectory whose history was rewritten mid-episode (a chat
template that drops earlier turns' reasoning, an agent that compacts its context) trains
every segment with the trajectory's advantage.

In process, TP = 1: trajectories cut into 1–3 segments (later segments either start with
the group's prompt, so the shared-prompt path takes them, or with a compacted context of
their own) stream exactly — thundersync one by one (pair folds), packed (segments of one
trajectory in one pass) and sync agree within 1e-6 and equal an FP64 reference written per
segment on the Hugging Face model within 1e-5, under the per-trajectory token norm (L_i
counts every segment) and token_mean. Then what a learner refuses: segments that disagree
about their trajectory, a segment missing at close, a scored count that does not add up.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers.in_process import as_sources, make_learner, run_update
from tests.helpers.off_policy import _hf
from tests.helpers.reference import rel_l2, segments_reference

VOCAB = 256


def _segmented_rows(seed: int = 3, n_groups: int = 3, m: int = 3) -> list[dict]:
    """GRPO rows, one per segment. Member i of group g has 1 + (g + i) % 3 segments;
    segment 0 starts with the group's prompt; a later one either keeps the prompt and
    drops the middle (a template that strips earlier reasoning) or starts afresh (a
    compacted context). Rewards differ within each group (non-zero advantages)."""
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        prompt = [rng.randrange(VOCAB) for _ in range(6)]
        for i in range(m):
            tid, n = f"g{g}-t{i}", 1 + (g + i) % 3
            segs = []
            for s in range(n):
                keep = s == 0 or rng.random() < 0.5
                head = list(prompt) if keep else [rng.randrange(VOCAB) for _ in range(5)]
                toks, mask = head, [0] * len(head)
                for _ in range(rng.randrange(1, 4)):
                    k, o = rng.randrange(1, 6), rng.randrange(1, 4)
                    toks += [rng.randrange(VOCAB) for _ in range(k + o)]
                    mask += [1] * k + [0] * o
                segs.append((toks, mask, len(prompt) if keep else None))
            total = sum(sum(x[1]) for x in segs)
            reward = rng.choice([0.0, 1.0]) + 0.1 * i
            for s, (toks, mask, plen) in enumerate(segs):
                row = dict(traj_id=tid, group_id=f"g{g}", tokens=toks, scored_mask=mask,
                           reward=reward, policy_version=0, prompt_len=plen)
                if n > 1:
                    row.update(segment=s, n_segments=n, trajectory_scored=total)
                rows.append(row)
    order = list(range(len(rows)))
    rng.shuffle(order)
    for r, o in zip(rows, order):
        r["ready_order"] = o
    return rows


@pytest.fixture(scope="module")
def rows():
    return _segmented_rows()


@pytest.fixture(scope="module")
def learners(tiny_qwen2, parallel1):
    return {norm: {"sync": (make_learner(parallel1, tiny_qwen2, schedule="sync",
                                     shared_prefix=False, token_norm=norm), len(_segmented_rows())),
                   "ts": (make_learner(parallel1, tiny_qwen2, schedule="thundersync", k_open=1,
                                   token_norm=norm), 1),
                   "ts_packed": (make_learner(parallel1, tiny_qwen2, schedule="thundersync",
                                          k_open=2, token_norm=norm), 4)}
            for norm in ("trajectory", "token_mean")}


def test_every_segment_trains_streamed_exactly_and_matches_fp64(tiny_qwen2, rows, learners):
    from tsync_mcore.observability.trace import tokens_digest
    model = _hf(tiny_qwen2)
    n_segmented = len({r["traj_id"] for r in rows if r.get("n_segments", 1) == 3})
    assert n_segmented >= 2
    for norm, lns in learners.items():
        srcs = as_sources(rows)
        res = {name: run_update(ln, srcs, chunk) for name, (ln, chunk) in lns.items()}
        ref = segments_reference(model, rows, norm)
        errs = {n: rel_l2(r.grad, res["sync"].grad) for n, r in res.items() if n != "sync"}
        err_ref = max(rel_l2(r.grad, ref) for r in res.values())
        print(f"{norm}: thundersync vs sync {max(errs.values()):.2e}, vs FP64 {err_ref:.2e}")
        assert max(errs.values()) <= 1e-6 and err_ref <= 1e-5, (norm, errs, err_ref)
        for name, r in res.items():
            # every segment's scored tokens trained; each segment a source of its own
            assert r.summary.scored_tokens == sum(sum(x["scored_mask"]) for x in rows)
            served = {(e.traj_id, e.segment): e for e in r.trace
                      if getattr(e, "kind", "") == "source" and e.served}
            assert len(served) == len(rows), name
            for x in rows:
                e = served[x["traj_id"], x.get("segment") if "segment" in x else None]
                assert e.tokens_sha256 == tokens_digest(x["tokens"], x["scored_mask"])
    ts = res["ts"].trace
    # response lengths (metrics): a trajectory's every segment, its tokens and scored ones
    from tsync_mcore.observability.metrics import trajectory_lengths
    lengths = trajectory_lengths(res["sync"].trace)
    for t in {x["traj_id"] for x in rows}:
        mine = [x for x in rows if x["traj_id"] == t]
        assert lengths[t] == (sum(sum(x["scored_mask"]) for x in mine),
                              sum(len(x["tokens"]) for x in mine)), t
    # the streamed path really ran: pair folds before a group's last segment arrived, and
    # later segments that start with the group's prompt ran against it
    assert any(getattr(e, "fold", None) == "pair" and e.segment is not None for e in ts)
    assert any(getattr(e, "segment", None) and e.context > 0 for e in ts)
    packed = res["ts_packed"].trace
    passes: dict[int, list] = {}
    for e in packed:
        if getattr(e, "pass_id", None) is not None:
            passes.setdefault(e.pass_id, []).append(e.traj_id)
    assert any(len(ts_) > len(set(ts_)) for ts_ in passes.values()), \
        "no pass held two segments of one trajectory"


def test_a_group_completes_only_with_every_segment(tiny_qwen2, parallel1, rows):
    """A trajectory's reward is known at its first segment, but its group stays open
    (pair folds) until its last segment has arrived; a close before then names it."""
    from tsync_mcore.channel.sources import BatchPlan, SourceError
    ln = make_learner(parallel1, tiny_qwen2, schedule="thundersync", k_open=4)
    srcs = [s for s in as_sources(rows, version=0) if s.group_id == "g0"]
    three = next(s for s in srcs if s.n_segments == 3)
    ln.begin(BatchPlan.from_sources(srcs))
    held = [s for s in srcs if s.traj_id == three.traj_id and s.segment == 2]
    for s in srcs:
        if s not in held:
            ln.submit(s)
    assert not ln.batch.queue.is_complete("g0")
    assert ln.waiting_for() == [f"{three.traj_id}/2"]
    with pytest.raises(SourceError, match=f"{three.traj_id}/2 missing"):
        ln.close()
    ln.abort()


@pytest.mark.parametrize("change,match", [
    (dict(reward=0.77), "reward 0.77, but its earlier segments came with"),
    (dict(n_segments=4, segment=2), "says 4 segments and"),
    (dict(trajectory_scored=10**4), "its first segment said"),
    (dict(n_segments=1, segment=0, trajectory_scored=None), "arrived in 3 segments, now as "
                                                            "segment 0 of 1"),
])
def test_segments_that_disagree_are_refused(tiny_qwen2, parallel1, rows, change, match):
    import dataclasses

    from tsync_mcore.channel.sources import BatchPlan, SourceError
    ln = make_learner(parallel1, tiny_qwen2, schedule="sync")
    srcs = as_sources(rows, version=0)
    ln.begin(BatchPlan.from_sources(srcs))
    three = [s for s in srcs if s.n_segments == 3]
    t = three[0].traj_id
    segs = sorted([s for s in three if s.traj_id == t], key=lambda s: s.segment)
    ln.submit(segs[0])
    with pytest.raises(SourceError, match=match):
        ln.submit(dataclasses.replace(segs[1], **change))
    ln.abort()


def test_a_whole_trajectory_takes_no_segment(tiny_qwen2, parallel1, rows):
    import dataclasses

    from tsync_mcore.channel.sources import BatchPlan, SourceError
    ln = make_learner(parallel1, tiny_qwen2, schedule="sync")
    srcs = as_sources(rows, version=0)
    one = next(s for s in srcs if s.n_segments == 1)
    ln.begin(BatchPlan.from_sources(srcs))
    ln.submit(one)
    with pytest.raises(SourceError, match="arrived as one sequence, now as segment 1 of 2"):
        ln.submit(dataclasses.replace(one, segment=1, n_segments=2,
                                      trajectory_scored=2 * one.n_scored))
    ln.abort()


def test_scored_tokens_must_add_up(tiny_qwen2, parallel1, rows):
    """trajectory_scored is what weighted the earlier segments: the last one must make it
    add up, and no segment may overshoot it."""
    import dataclasses

    from tsync_mcore.channel.sources import BatchPlan, SourceError
    ln = make_learner(parallel1, tiny_qwen2, schedule="sync")
    srcs = as_sources(rows, version=0)
    t = next(s.traj_id for s in srcs if s.n_segments == 2)
    segs = sorted([s for s in srcs if s.traj_id == t], key=lambda s: s.segment)
    total = segs[0].trajectory_scored + 1
    fake = [dataclasses.replace(s, trajectory_scored=total) for s in segs]
    ln.begin(BatchPlan.from_sources(srcs))
    ln.submit(fake[0])
    with pytest.raises(SourceError, match=f"score {total - 1} tokens, trajectory_scored "
                                          f"says {total}"):
        ln.submit(fake[1])
    ln.abort()


def test_replay_lines_carry_segments(tmp_path, rows):
    """A replay file's segment lines: read back as the sources they were, a segment twice
    in one update refused with its line, a bad segment index named."""
    from tsync_mcore.channel.sources import SourceError, TrajectorySource, validate_source
    from tsync_mcore.learner.replay import batches_from_lines
    srcs = as_sources(rows)
    lines = [json.dumps(s.to_json()).encode() for s in srcs]
    batch = batches_from_lines("b.jsonl", lines)[0]
    assert [(s.key, s.tokens) for s in batch] == [(s.key, s.tokens) for s in srcs]
    seg = next(s for s in srcs if s.n_segments > 1)
    with pytest.raises(SourceError, match=r"b.jsonl:\d+: trajectory .* appears twice"):
        batches_from_lines("b.jsonl", lines + [json.dumps(
            {**seg.to_json(), "ready_order": 999}).encode()])
    bad = TrajectorySource.from_json({**seg.to_json(), "segment": seg.n_segments})
    with pytest.raises(SourceError, match=r"segment must be an integer in \[0, "):
        validate_source(bad, VOCAB)
    lone = TrajectorySource.from_json({**seg.to_json(), "trajectory_scored": None})
    with pytest.raises(SourceError, match="without trajectory_scored"):
        validate_source(lone, VOCAB)


def test_segments_on_two_ranks_balanced_static_and_tp(tiny_qwen2, rows, tmp_path):
    """One launch of 2 ranks: balanced routing (each trajectory's segments to one rank,
    the group's rewards announced after its last member's last segment) under thundersync,
    static routing under sync, and TP = 2 under thundersync: every gradient equals the FP64
    reference."""
    from safetensors.torch import load_file

    from tests.helpers.replay import replay_many
    batch = tmp_path / "segments.jsonl"
    batch.write_text("".join(json.dumps(dict(r, update=0)) + "\n" for r in rows))
    common = ["--model", tiny_qwen2, "--batch", str(batch), "--lr", "1e-5"]
    jobs = {"balanced_ts": [*common, "--routing", "balanced", "--schedule", "thundersync",
                            "--k-open", "1"],
            "static_sync": [*common, "--schedule", "sync"],
            "tp2_ts": [*common, "--tp", "2", "--schedule", "thundersync", "--k-open", "1"]}
    runs = replay_many(jobs, str(tmp_path), nproc=2)
    ref = segments_reference(_hf(tiny_qwen2), rows, "trajectory")
    grads = {n: load_file(f"{r['dir']}/grad.safetensors") for n, r in runs.items()}
    errs = {n: rel_l2(g, ref) for n, g in grads.items()}
    print("segments on 2 ranks vs FP64: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert max(errs.values()) <= 1e-5, errs
    assert rel_l2(grads["balanced_ts"], grads["static_sync"]) <= 1e-6
