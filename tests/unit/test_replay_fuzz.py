"""Replay files are untrusted input: every bad line is refused up front, before any model
is built, with one `FILE:LINE: problem` message — never a traceback or a silent run.

Fast: the line validator is pure (tsync_mcore.learner.replay.batches_from_lines); the CLI tests stop
before the model is built.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.batchgen import make_opd_batch, write_batches, write_opd_batches
from tests.helpers.replay_fuzz_shared import GRPO, VOCAB, json_line, write_lines
from tsync_mcore.channel.sources import (
    BatchPlan,
    SourceError,
    TrajectorySource,
    TurnSource,
    validate_source,
    validate_turn,
)
from tsync_mcore.learner import replay
from tsync_mcore.learner.replay import (
    OutError,
    batches_from_lines,
    check_out,
    read_batches,
)

OPD = make_opd_batch(VOCAB, n_traj=4, turns=3, seed=5)
KIND = {"grpo": ("trajectory", GRPO), "opd": ("turn", OPD)}


def _refused(tmp_path, rows, line, *words, kind="grpo") -> str:
    """The file is refused with a message naming FILE:LINE (line None: the file) and words."""
    path = write_lines(tmp_path, rows)
    with pytest.raises(SourceError) as e:
        read_batches(path, KIND[kind][0])
    msg = str(e.value)
    where = f"{path}:{line}: " if line is not None else f"{path}: "
    assert msg.startswith(where), msg
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def _without(row, key):
    return {k: v for k, v in row.items() if k != key}


@pytest.mark.parametrize("bad,words", [
    (dict(GRPO[1], tokens=None), ["tokens", "list of integers", "null"]),
    (dict(GRPO[1], tokens=7), ["tokens", "got 7"]),
    (dict(GRPO[1], tokens=[1, "2"]), ["tokens", "item 1"]),
    (dict(GRPO[1], scored_mask=[0, True]), ["scored_mask", "true"]),
    (dict(GRPO[1], policy_version=None), ["policy_version", "integer", "null"]),
    (dict(GRPO[1], policy_version="0"), ["policy_version", "'0'"]),
    (dict(GRPO[1], reward="0.5"), ["reward", "finite number"]),
    (dict(GRPO[1], reward=math.nan), ["reward", "finite number", "nan"]),
    (dict(GRPO[1], traj_id=None), ["traj_id", "string or an integer"]),
    (dict(GRPO[1], prompt_len="6"), ["prompt_len", "integer or null"]),
    ([1, 2, 3], ["JSON object", "a list"]),
    (42, ["JSON object", "42"]),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", ["not UTF-8", "binary"]),
    (b'{"traj_id": "t", "tokens": [1, 2', ["invalid JSON", "column"]),
    (b'{"traj_id": "a", "traj_id": "b"}', ["'traj_id'", "twice"]),
])
def test_wrong_types_are_refused_with_file_and_line(tmp_path, bad, words):
    _refused(tmp_path, [GRPO[0], bad], 2, *words)


@pytest.mark.parametrize("bad,words", [
    (dict(OPD[1], teacher_logprobs=[None, "x"]), ["teacher_logprobs", "numbers or nulls"]),
    (dict(OPD[1], turn_ends=None), ["turn_ends", "null"]),
    (dict(OPD[1], turn_ready_order=[0.5, 1, 2]), ["turn_ready_order", "item 0", "0.5"]),
    (dict(OPD[1], tokens={"a": 1}), ["tokens", "an object"]),
])
def test_opd_wrong_types_are_refused(tmp_path, bad, words):
    _refused(tmp_path, [OPD[0], bad], 2, *words, kind="opd")


def test_unknown_and_misspelt_keys_are_refused_with_a_suggestion(tmp_path):
    bad = _without(GRPO[1], "ready_order") | {"ready_ordr": 1}
    msg = _refused(tmp_path, [GRPO[0], bad], 2, "unknown field 'ready_ordr'",
                   "did you mean 'ready_order'?")
    assert "missing field" not in msg  # ready_order is optional: the misspelling is the problem
    _refused(tmp_path, [GRPO[0], dict(GRPO[1], colour="red")], 2, "unknown field 'colour'")
    _refused(tmp_path, [GRPO[0], _without(GRPO[1], "reward") | {"rewrd": 1.0}], 2,
             "'rewrd' (did you mean 'reward'?)", "missing field 'reward'")


def test_record_of_the_other_objective_gets_a_hint(tmp_path):
    _refused(tmp_path, [OPD[0]], 1, "unknown fields", "--objective opd")
    _refused(tmp_path, [GRPO[0]], 1, "missing field", "GRPO record", kind="opd")


def test_ready_order_rule(tmp_path):
    a, b = GRPO[0], GRPO[1]
    _refused(tmp_path, [a, dict(b, ready_order=a["ready_order"])], 2,
             f"ready_order {a['ready_order']}", "line 1")
    _refused(tmp_path, [a, _without(b, "ready_order")], 2, "missing field 'ready_order'", "line 1")
    _refused(tmp_path, [_without(a, "ready_order"), b], 2, "ready_order given", "line 1")
    _refused(tmp_path, [a, dict(b, ready_order=2.5)], 2, "ready_order must be an integer", "2.5")
    _refused(tmp_path, [a, dict(b, ready_order=True)], 2, "ready_order must be an integer")
    # Absent on every line: arrival is file order.
    rows = [_without(r, "ready_order") for r in GRPO]
    [batch] = read_batches(write_lines(tmp_path, rows, "plain.jsonl"))
    assert [s.traj_id for s in batch] == [r["traj_id"] for r in rows]
    # The same place in different updates is fine: each update has its own arrival order.
    path = str(tmp_path / "multi.jsonl")
    write_batches(path, VOCAB, n_updates=3, seed=1, n_groups=2, m=2)
    batches = read_batches(path)
    assert [len(b) for b in batches] == [4, 4, 4]
    assert all([s.ready_order for s in b] == [0, 1, 2, 3] for b in batches)


def test_opd_turn_ready_order_unique_across_turns(tmp_path):
    a, b = OPD[0], OPD[1]
    taken = a["turn_ready_order"][1]
    b2 = dict(b, turn_ready_order=[taken] + b["turn_ready_order"][1:])
    _refused(tmp_path, [a, b2], 2, f"turn_ready_order[0] {taken}", "line 1", kind="opd")
    a2 = dict(a, turn_ready_order=[9, 9, 10])
    _refused(tmp_path, [a2], 1, "turn_ready_order[1] 9", "earlier turn", kind="opd")
    _refused(tmp_path, [a, _without(b, "turn_ready_order")], 2, "missing field 'turn_ready_order'",
             kind="opd")


def test_duplicate_trajectory_and_version_gaps(tmp_path):
    _refused(tmp_path, [GRPO[0], dict(GRPO[0], ready_order=99)], 2, "appears twice", "line 1")
    _refused(tmp_path, [GRPO[0], dict(GRPO[1], policy_version=2)], 2, "policy_version 2",
             "no line has policy_version 1")
    _refused(tmp_path, [dict(GRPO[0], policy_version=-1), GRPO[1]], 1, "negative")


def test_empty_file_names_the_file(tmp_path):
    _refused(tmp_path, [], None, "no sources")
    _refused(tmp_path, [b"", b"   ", b"\t"], None, "no sources")
    with pytest.raises(SourceError, match=r"nope\.jsonl: cannot read"):
        read_batches(str(tmp_path / "nope.jsonl"))


def test_valid_files_are_read_as_before(tmp_path):
    """Accepted inputs stay accepted: the generated files, int ids, null prompt_len,
    blank lines and a BOM."""
    path = str(tmp_path / "g.jsonl")
    rows = write_batches(path, VOCAB, n_updates=2, seed=2)
    batches = read_batches(path)
    assert sum(map(len, batches)) == len(rows)
    assert all(b == sorted(b, key=lambda s: s.ready_order) for b in batches)
    path = str(tmp_path / "o.jsonl")
    rows = write_opd_batches(path, VOCAB, n_updates=2, seed=2)
    batches = read_batches(path, "turn")
    assert sum(map(len, batches)) == sum(len(r["turn_ends"]) for r in rows)
    odd = [dict(GRPO[0], traj_id=5, group_id=7, prompt_len=None), b"", GRPO[1]]
    lines = [b"\xef\xbb\xbf" + json_line(odd[0])] + [json_line(r) for r in odd[1:]]
    [batch] = batches_from_lines("odd.jsonl", lines)
    assert {s.traj_id for s in batch} == {"5", GRPO[1]["traj_id"]}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=8)


def _misspell(key: str, i: int) -> str:
    i %= len(key)
    return key[:i] + key[i + 1:] if i % 2 else key[:i] + key[i] + key[i:]


@st.composite
def mutated_line(draw, rows):
    row = dict(draw(st.sampled_from(rows[1:])))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["drop", "extra", "misspell", "retype", "item", "whole",
                                   "bytes", "corrupt"]))
        key = draw(st.sampled_from(sorted(row))) if row else "traj_id"
        if op == "drop":
            row.pop(key, None)
        elif op == "extra":
            row[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
        elif op == "misspell" and key in row:
            row[_misspell(key, draw(st.integers(0, 30)))] = row.pop(key)
        elif op == "retype":
            row[key] = draw(json_values)
        elif op == "item" and isinstance(row.get(key), list) and row[key]:
            row[key] = list(row[key])
            row[key][draw(st.integers(0, len(row[key]) - 1))] = draw(json_values)
        elif op == "whole":
            return json.dumps(draw(json_values)).encode()
        elif op == "bytes":
            return draw(st.binary(max_size=64))
        elif op == "corrupt":
            raw = bytearray(json_line(row))
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
            return bytes(raw.replace(b"\n", b" "))
    return json_line(row)


def _well_typed(s) -> bool:
    ints = lambda xs: isinstance(xs, tuple) and all(type(x) is int for x in xs)  # noqa: E731
    ok = (isinstance(s.traj_id, str) and isinstance(s.group_id, str) and ints(s.tokens)
          and ints(s.scored_mask) and type(s.policy_version) is int and type(s.ready_order) is int
          and (s.prompt_len is None or type(s.prompt_len) is int))
    if isinstance(s, TurnSource):
        return ok and all(x is None or type(x) in (int, float) for x in s.teacher_logprobs)
    return ok and type(s.reward) in (int, float) and math.isfinite(s.reward)


@pytest.mark.parametrize("kind", ["grpo", "opd"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_lines_are_accepted_or_refused_with_location(kind, data):
    source, rows = KIND[kind]
    line = data.draw(mutated_line(rows))
    try:
        batches = batches_from_lines("fuzz.jsonl", [json_line(rows[0]), line], source)
    except SourceError as e:
        msg = str(e)
        assert re.match(r"fuzz\.jsonl:[12]: \S", msg), msg
        assert "\n" not in msg, msg
        return
    # Accepted: the sources are well typed, and the value checks and batch plan either
    # pass or refuse with a SourceError (anything else fails this test).
    for batch in batches:
        assert all(_well_typed(s) for s in batch), batch
        for s in batch:
            try:
                (validate_turn if kind == "opd" else validate_source)(s, VOCAB)
            except SourceError:
                pass
        try:
            BatchPlan.from_sources(batch)
        except SourceError:
            pass


def test_unmutated_lines_pass_every_check():
    """The property's baseline: its valid records are accepted and pass the value checks."""
    for kind, (source, rows) in KIND.items():
        [batch] = batches_from_lines("ok.jsonl", [json_line(r) for r in rows], source)
        for s in batch:
            (validate_turn if kind == "opd" else validate_source)(s, VOCAB)
            assert _well_typed(s)
        assert isinstance(batch[0], TurnSource if kind == "opd" else TrajectorySource)


def test_out_checked(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutError, match="exists and is not a directory"):
        check_out(str(f))
    with pytest.raises(OutError, match="is not a directory, so"):
        check_out(str(f / "sub" / "out"))
    (tmp_path / "o" / "grad.safetensors").mkdir(parents=True)
    with pytest.raises(OutError, match="grad.safetensors is a directory"):
        check_out(str(tmp_path / "o"))
    if os.path.isdir("/proc/self"):
        with pytest.raises(OutError, match="cannot write in /proc"):
            check_out("/proc/self/replay-out")
    check_out(str(tmp_path / "new" / "deeper"))  # creatable: fine, and nothing made yet
    assert not (tmp_path / "new").exists()
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(OutError, match="cannot write"):
            check_out(str(ro / "out"))


def _main_args(batch, out, *extra):
    return ["--model", "/nonexistent-model", "--batch", batch, "--out", out, *extra]


def test_bad_out_or_batch_fails_before_the_model_is_built(tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("the model was built")
    monkeypatch.setattr(replay, "Policy", no_model)
    good = str(tmp_path / "g.jsonl")
    write_batches(good, VOCAB, seed=1)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutError, match="not a directory"):
        replay.main(_main_args(good, str(f)))
    bad = write_lines(tmp_path, [GRPO[0], dict(GRPO[1], tokens=None)], "bad.jsonl")
    with pytest.raises(SourceError, match=re.escape(f"{bad}:2: ")):
        replay.main(_main_args(bad, str(tmp_path / "out")))
    with pytest.raises(SourceError, match="no sources"):
        replay.main(_main_args(write_lines(tmp_path, [], "empty.jsonl"), str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()
