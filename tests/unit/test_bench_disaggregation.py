"""`duet bench disaggregation`'s table: every point of every mode, and auto's goodput
against the better of always and never."""

from __future__ import annotations

import pytest

from bench.disaggregation import row, table

pytestmark = pytest.mark.unit


def _point(rate: float, goodput: float) -> dict:
    ms = {"median": 100.0, "p90": 150.0}
    return {"x": rate, "metrics": {"completed": 8, "failed": 0, "goodput": goodput, "goodput_ratio": 1.0,
                                   "ttft_ms": ms, "tpot_ms": ms, "output_throughput": 42.0}}


def test_the_table_compares_auto_with_the_better_of_the_others():
    result = {"workloads": ["short"], "rates": {"short": [0.5]},
              "modes": {m: {"short": [row(_point(0.5, g))]} for m, g in
                        (("always", 0.30), ("never", 0.40), ("auto", 0.38))}}
    text = table(result)
    assert "| short | 0.5 | never | 0.400 | 100 / 150 | 100.0 / 150.0 | 42.0 |" in text
    assert "short @ 0.5 req/s: auto 0.380 vs best of the others 0.400 (-0.020)" in text
