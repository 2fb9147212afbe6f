"""Metric definitions of `vllm bench serve`, checked on hand-computed cases."""

import pytest

from loadgen.metrics import SLO, compute_metrics, parse_goodput
from loadgen.records import Outcome, RequestResult

pytestmark = pytest.mark.unit


def words(text: str) -> int:
    return len(text.split())


def rec(send, chunks, texts, outcome=Outcome.COMPLETED, end=None, warmup=False):
    r = RequestResult(0, 0, prompt_tokens=10, max_tokens=16, ignore_eos=False, warmup=warmup)
    r.send_time, r.chunk_times, r.chunk_texts = send, list(chunks), list(texts)
    r.text = "".join(texts)
    r.outcome = outcome
    r.end_time = end if end is not None else (chunks[-1] if chunks else send)
    return r


def test_ten_second_window_counts_failed_and_unfinished():
    # 5 submitted in 10 s: 3 completed (2 meet the SLO), 1 rejected, 1 unfinished.
    good1 = rec(0.0, [0.1, 0.2], ["a ", "b"])
    good2 = rec(1.0, [1.1], ["a"])
    slow = rec(2.0, [4.0, 4.1], ["a ", "b"])  # TTFT 2 s > 1 s
    rejected = rec(3.0, [], [], Outcome.FAILED, end=3.01)
    rejected.error, rejected.http_status = "HTTP 429: queue full", 429
    unfinished = rec(4.0, [4.5], ["a "], Outcome.UNFINISHED, end=9.0)
    m, _ = compute_metrics([good1, good2, slow, rejected, unfinished], 10.0, words, SLO(ttft_ms=1000))
    assert (m.submitted, m.completed, m.failed, m.unfinished) == (5, 3, 1, 1)
    assert m.request_throughput == pytest.approx(0.3)
    assert m.goodput == pytest.approx(0.2)
    assert m.goodput_ratio == pytest.approx(0.4)
    assert m.completion_ratio == pytest.approx(0.6)


def test_vllm_formulas_on_recorded_streams():
    # A: TTFT 0.1, E2EL 0.3, 4 tokens -> TPOT 0.2/3; ITLs 0.05, 0.10, 0.05
    a = rec(0.0, [0.10, 0.15, 0.25, 0.30], ["a ", "b ", "c ", "d"])
    # B: TTFT 0.2, E2EL 0.5, 3 tokens (2 in one chunk) -> TPOT 0.3/2; ITL 0.3
    b = rec(1.0, [1.2, 1.5], ["x y ", "z"])
    # C: one token -> no TPOT sample; TPOT counts as 0 for goodput
    c = rec(2.0, [2.05], ["q"])
    warm = rec(5.0, [9.0], ["slow"], warmup=True)  # excluded everywhere
    m, per = compute_metrics([a, b, c, warm], 2.0, words, parse_goodput(["ttft:150", "tpot:100"]))
    assert [p.output_tokens for p in per] == [4, 3, 1]
    assert m.total_output_tokens == 8 and m.submitted == 3
    assert m.output_throughput == pytest.approx(4.0)
    assert m.ttft_ms["mean"] == pytest.approx((100 + 200 + 50) / 3)
    assert m.ttft_ms["median"] == pytest.approx(100)
    assert m.tpot_ms["mean"] == pytest.approx((200 / 3 + 150) / 2)
    assert m.itl_ms["mean"] == pytest.approx(125)  # pooled: 50, 100, 50, 300
    assert m.itl_ms["median"] == pytest.approx(75)
    assert m.itl_ms["p99"] == pytest.approx(100 + 0.97 * 200)  # numpy linear interpolation
    assert m.e2el_ms["mean"] == pytest.approx((300 + 500 + 50) / 3)
    # A good; B fails TTFT (200 > 150); C good with TPOT 0.
    assert m.good == 2 and m.goodput == pytest.approx(1.0)


def test_slo_is_inclusive_and_every_slo_must_hold():
    r = rec(0.0, [0.5, 1.0, 1.5], ["a ", "b ", "c"])  # TTFT 500, TPOT 500, E2EL 1500
    assert compute_metrics([r], 1.0, words, parse_goodput(["ttft:500", "tpot:500"]))[0].good == 1
    assert compute_metrics([r], 1.0, words, parse_goodput(["ttft:500", "e2el:1499"]))[0].good == 0


def test_parse_goodput_rejects_unknown_keys():
    assert parse_goodput(["ttft:1", "e2el:3"]) == SLO(1.0, None, 3.0)
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])


def test_no_completed_requests_gives_empty_stats():
    bad = rec(0.0, [], [], Outcome.FAILED, end=0.1)
    m, _ = compute_metrics([bad], 1.0, words, SLO(ttft_ms=1))
    assert m.completed == 0 and m.ttft_ms["mean"] is None and m.goodput_ratio == 0.0
