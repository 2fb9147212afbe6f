"""`duet bench efficiency`'s own logic: the in-process closed loop and the table."""

from __future__ import annotations

import pytest

from bench.efficiency import closed_loop, table

pytestmark = pytest.mark.unit


def test_the_closed_loop_runs_every_prompt_with_at_most_concurrency_in_flight(engine):
    running = []
    step = engine.step

    def counting_step():
        running.append(len(engine.scheduler.requests))
        return step()

    engine.step = counting_step
    row = closed_loop(engine, ["one two", "three four", "five six", "seven"], output_len=3, concurrency=2)
    assert row["completed"] == 4 and row["output_tok_s"] > 0
    assert max(running) == 2 and not engine.has_unfinished()
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]


def test_the_table_gives_each_way_as_a_share_of_in_process_and_the_mode_ratios():
    def row(c, tok_s, ttft):
        return {"concurrency": c, "output_tok_s": tok_s, "ttft_p50_ms": ttft, "tpot_p50_ms": 10.0}

    text = table({"in_process": [row(1, 20.0, 50)], "aggregated": [row(1, 15.0, 100)],
                  "disaggregated": [row(1, 12.0, 110)]})
    assert "| aggregated | 1 | 15.0 | 75% | - | 100 | 10.0 |" in text
    assert "| disaggregated | 1 | 12.0 | 60% | - | 110 | 10.0 |" in text
    assert "c=1: disaggregated/aggregated throughput 80%, TTFT p50 +10 ms" in text
    with_ceiling = table({"in_process": [row(1, 20.0, 50)], "aggregated": [row(1, 15.0, 100)],
                          "ceilings": {"decode_tok_s": {"1": 40.0}}})
    assert "| in_process | 1 | 20.0 | 100% | 50% | 50 | 10.0 |" in with_ceiling
    assert "| aggregated | 1 | 15.0 | 75% | 38% | 100 | 10.0 |" in with_ceiling
