"""Shared by the tests of ledger: tests/unit/test_ledger.py, tests/integration/test_ledger.py."""

from __future__ import annotations

from tsync_mcore.observability.ledger import train_flops


TOL = 0.02  # brief: ledger within 2 % of torch's counter


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


def check(results: list[dict], spec, tp: int) -> None:
    """Each counted (per-rank) figure vs the ledger's whole-model figure / tp."""
    for r in results:
        b = train_flops(spec, r["seq_lens"], frozen=r["frozen"]).per_rank(tp)
        where = f"{r['case']} {r['seq_lens']} tp={tp}"
        assert rel(b.forward, r["forward"]) < TOL, (where, b.forward, r["forward"])
        assert rel(b.total, r["total"]) < TOL, (where, b.total, r["total"])
