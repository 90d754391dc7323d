"""Shared by the tests of trace: tests/unit/test_trace.py, tests/integration/test_trace.py."""

from __future__ import annotations

import json

from tsync_mcore.observability import trace


def record_json(rec) -> dict:
    return json.loads(trace.to_json(rec))
