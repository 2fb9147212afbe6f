"""`duet bench efficiency`'s own logic: the in-process closed loop and the table."""

from __future__ import annotations

import pytest

from bench.efficiency import closed_loop, median_rows, table

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


def test_with_step_traces_the_table_gives_each_engine_and_the_steady_ratio():
    def engine(rate: float) -> dict:
        return {"steps": 10, "busy": 0.9, "threads": {"1": 2, "2": 8}, "step_ms_p50": 25.0,
                "steady": {"seconds": 5.0, "outputs_per_s": rate, "mean_batch": 7.5, "busy": 0.99,
                           "full_team": 0.8}}

    def row(tok_s, engines):
        return {"concurrency": 8, "output_tok_s": tok_s, "ttft_p50_ms": 100, "tpot_p50_ms": 30.0,
                "engines": engines}

    agg, dis = row(240.0, {"aggregated-11": engine(250.0)}), row(200.0, {"prefill-12": engine(3.0),
                                                                         "decode-13": engine(240.0)})
    text = table({"in_process": [row(250.0, {})], "aggregated": [agg], "disaggregated": [dis],
                  "rounds": [{"aggregated": [agg], "disaggregated": [dis]}]})
    assert ("aggregated c=8 aggregated-11: busy 90%, steps by team size {'1': 2, '2': 8}, step p50 25.0 ms; "
            "steady 5.0 s: 250.0 tok/s (client 240.0), batch 7.5, busy 99%, 80% of steps on the full team") in text
    assert "disaggregated c=8 prefill-12: busy 90%" in text and "steady 5.0 s: 3.0" not in text
    assert "c=8: steady disaggregated/aggregated 96%" in text


def test_rounds_give_median_rows_and_each_round_its_own_ratio():
    def row(tok_s: float, ttft: float) -> dict:
        return {"concurrency": 8, "completed": 16, "output_tok_s": tok_s, "ttft_p50_ms": ttft, "tpot_p50_ms": 30.0}

    engine = [[row(250.0, 300.0)], [row(260.0, 300.0)], [row(300.0, 300.0)]]
    agg = [[row(200.0, 500.0)], [row(260.0, 450.0)], [row(240.0, 470.0)]]
    dis = [[row(190.0, 400.0)], [row(200.0, 420.0)], [row(240.0, 380.0)]]
    assert median_rows(agg) == [row(240.0, 470.0)]
    text = table({"in_process": median_rows(engine), "aggregated": median_rows(agg),
                  "disaggregated": median_rows(dis),
                  "rounds": [{"in_process": e, "aggregated": a, "disaggregated": d}
                             for e, a, d in zip(engine, agg, dis)]})
    assert "c=8: disaggregated/aggregated throughput 83%, TTFT p50 -70 ms" in text
    assert "The rows are medians of 3 rounds; each round's own ratios:" in text
    assert "c=8: aggregated/in_process by round 80%, 100%, 80%, median 80%" in text
    assert "c=8: disaggregated/aggregated by round 95%, 77%, 100%, median 95%" in text
