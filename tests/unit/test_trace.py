"""The trace schema: every record kind round-trips, damaged lines are named, the CLIs that
read traces stop with one line (exit 2), and docs/design/trace.md shows the schema as it is."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.records import deferred, source, update
from tests.helpers.trace_shared import record_json
from tsync_mcore.observability import trace
from tsync_mcore.observability.trace import SCHEMA_VERSION, TraceError


def test_every_record_kind_round_trips(tmp_path):
    records = [
        source(traj_id="v0-g0-t0", ready=0.25, start=0.5, end=1.5, fold="pair", closes_group=True,
               open_groups=2, span_tokens=40, context=8),
        source(traj_id="v0-g0-t1", turn=3, ready=2.0),  # an OPD turn, not served here
        deferred(work="replay", spans=[(10, 7), (6, 0)], replay_mode="retain"),
        deferred(work="prefix", traj_id=None, spans=[(16, 0)], replay_mode=None),
        update(dropped_groups={"g1": "reward missing"}, rejected_sources=[("x", "stale")],
               open_bound="k_open=4", accum_peak_bytes=3, kv_peak_bytes=5, grad_norm=0.5,
               ok=False),
    ]
    path = str(tmp_path / "rank0.jsonl")
    trace.write(path, records[:2])
    trace.write(path, records[2:])  # appends, as the trainer does per update
    back = trace.read(path)
    assert back == records
    assert [type(r) for r in back] == [type(r) for r in records]
    assert back[2].spans == [(10, 7), (6, 0)]  # tuples again, not JSON lists
    assert [r.served for r in back] == [True, False, True, True, False]
    assert trace.work(back) == [records[0], records[2], records[3]]
    assert trace.sources(back) == records[:2]
    assert all(json.loads(line)["schema"] == SCHEMA_VERSION for line in open(path))


def test_read_run_reads_every_rank_in_order(tmp_path):
    (tmp_path / "traces").mkdir()
    for r in (10, 2, 0):
        trace.write(str(tmp_path / "traces" / f"rank{r}.jsonl"), [source(rank=r)])
    assert [r.rank for r in trace.read_run(str(tmp_path))] == [0, 2, 10]
    assert trace.read_run(str(tmp_path / "missing")) == []


def test_a_line_still_being_written_is_skipped(tmp_path):
    path = tmp_path / "rank0.jsonl"
    line = trace.to_json(source())
    path.write_text(line + "\n\n" + line[:20])
    assert trace.read(str(path)) == [source()]


@pytest.mark.parametrize("damage,message", [
    (lambda o: o | {"schema": SCHEMA_VERSION + 1},
     f"trace schema {SCHEMA_VERSION + 1}, this reader speaks {SCHEMA_VERSION}"),
    (lambda o: {k: v for k, v in o.items() if k != "schema"}, "trace schema None"),
    (lambda o: o | {"kind": "turn"}, "unknown record kind 'turn'"),
    (lambda o: o | {"kind": ["source"]}, "unknown record kind ['source']"),
    (lambda o: o | {"span": 3}, "source record has unknown fields ['span']"),
    (lambda o: {k: v for k, v in o.items() if k != "ready"}, "missing 1 required"),
    (lambda o: o | {"ready": "soon"}, "ready must be float, got 'soon'"),
    (lambda o: o | {"rank": True}, "rank must be int"),
    (lambda o: o | {"fold": "sideways"}, "fold must be"),
    (lambda o: [o], "a record must be a JSON object, got list"),
])
def test_parse_rejects_a_damaged_record_naming_file_and_line(tmp_path, damage, message):
    path = tmp_path / "rank0.jsonl"
    good = trace.to_json(source())
    path.write_text(good + "\n" + json.dumps(damage(record_json(source()))) + "\n")
    with pytest.raises(TraceError) as e:
        trace.read(str(path))
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_parse_rejects_bad_json_and_bad_spans(tmp_path):
    path = tmp_path / "rank1.jsonl"
    path.write_text('{"schema": 1, "kind": \n')
    with pytest.raises(TraceError, match=rf"^{path}:1: not JSON"):
        trace.read(str(path))
    spans = record_json(deferred()) | {"spans": [[1, 2, 3]]}
    with pytest.raises(TraceError, match=r"^here: deferred record: spans must be"):
        trace.parse(spans, "here")


def test_docs_show_the_generated_field_table():
    with open(os.path.join(ROOT, "docs", "design", "trace.md")) as f:
        doc = f.read()
    assert trace.field_table() in doc, "regenerate: python -m tsync_mcore.observability.trace > table"
