"""The autoscaling signals replicas and the gateway compute (autoscaling/signals.py),
on a fake clock."""

import pytest

from autoscaling import signals as sig
from autoscaling.signals import (
    BusyTime,
    DecodeSignals,
    GatewaySignals,
    LoadSnapshot,
    PrefillSignals,
    ReplicaReport,
    Window,
)

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_window_keeps_its_span_and_gives_quantiles_and_rates():
    c = Clock()
    w = Window(10.0, c)
    for v in range(1, 11):
        w.add(float(v))
    assert w.quantile(0.9) == 9.0 and w.quantile(0.5) == 5.0
    c.now += 5  # younger than its span: the rate is over the time since it started
    assert w.rate() == pytest.approx(55 / 5)
    c.now += 6  # every sample is now older than the span
    assert w.quantile(0.9) is None and w.count() == 0 and w.rate() == 0.0


def test_busy_time_counts_overlapping_intervals_once():
    c = Clock()
    b = BusyTime(10.0, c)
    b.add(91.0, 93.0)
    b.add(92.0, 95.0)  # overlaps the first
    b.add(97.0, 98.0)
    b.add(80.0, 85.0)  # before the window
    assert b.seconds() == pytest.approx(4.0 + 1.0)


def test_prefill_reports_queue_speed_and_latency():
    c = Clock()
    s = PrefillSignals(clock=c)
    # Two 1,000-token prompts, the second with 400 cached, computed back to back over 2 s.
    s.request(arrival=97.0, first_scheduled=98.0, first_token=99.0, finished=99.0, prompt_tokens=1000, cached_tokens=0)
    s.request(arrival=97.5, first_scheduled=99.0, first_token=100.0, finished=100.0, prompt_tokens=1000,
              cached_tokens=400)
    r = s.report(LoadSnapshot(queued_prefill_tokens=300, num_waiting=1, num_running=1))
    assert r[sig.QUEUED_PROMPT_TOKENS] == 300 and r[sig.WAITING] == 1
    assert r[sig.CAPACITY_TOKENS_PER_S] == pytest.approx(1600 / 2.0)
    assert r[sig.QUEUE_WAIT_MS] == pytest.approx(1500.0)
    assert r[sig.REPLICA_TTFT_MS] == pytest.approx(2500.0)


def test_prefill_reports_no_speed_from_under_a_second_of_work():
    s = PrefillSignals(clock=Clock())
    s.request(99.5, 99.6, 99.9, 99.9, 100, 0)
    assert s.report(LoadSnapshot())[sig.CAPACITY_TOKENS_PER_S] == 0


def test_gateway_goodput_judges_both_slos_and_failures():
    g = GatewaySignals(ttft_ms=1000, tpot_ms=100, clock=Clock())
    assert g.report()[sig.GOODPUT] == -1.0 and g.goodput() is None  # no sample yet
    g.finished(0.5, 0.05, ok=True)  # good
    g.finished(1.5, 0.05, ok=True)  # TTFT missed
    g.finished(0.5, 0.2, ok=True)  # TPOT missed
    g.finished(0.5, None, ok=False)  # failed
    assert g.goodput() == 0.25
    r = g.report()
    assert r[sig.FINISHED] == 4 and r[sig.GOODPUT] == 0.25 and r[sig.TTFT_MS] == pytest.approx(1500.0)


def test_a_missing_or_negative_value_reads_as_no_sample():
    r = ReplicaReport("x", 1.0, {sig.TTFT_MS: -1.0, sig.RUNNING: 3.0})
    assert r.get(sig.TTFT_MS) is None and r.get(sig.WAITING) is None and r.get(sig.RUNNING) == 3.0


def test_decode_reports_the_mean_batch_its_tpot_was_measured_at():
    c = Clock()
    s = DecodeSignals(span_s=10.0, clock=c)
    c.now += 10
    for _ in range(3):  # three sequences, each decoding for the last 8 s: a batch of 2.4
        s.request(first_scheduled=c.now - 8, finished=c.now, output_tokens=81)
    r = s.report(LoadSnapshot(kv_blocks_total=10, kv_blocks_free=10), waiting_imports=0)
    assert r[sig.MEAN_BATCH] == pytest.approx(2.4)
    assert r[sig.REPLICA_TPOT_MS] == pytest.approx(100.0) and r[sig.MEAN_TPOT_MS] == pytest.approx(100.0)
    assert r[sig.KV_BLOCKS_USED] == 0


def test_decode_reports_the_prompt_tokens_it_prefilled_itself_per_second():
    c = Clock()
    s = DecodeSignals(span_s=20.0, clock=c)
    c.now += 10
    report = lambda: s.report(LoadSnapshot(), waiting_imports=0)[sig.LOCAL_PROMPT_TOKENS_PER_S]  # noqa: E731
    assert report() == 0.0
    s.prefilled_here(300, at=c.now - 1)
    s.prefilled_here(200, at=c.now)
    assert report() == pytest.approx(500 / sig.RATE_WINDOW_S)  # a rate over the short window
    c.now += sig.RATE_WINDOW_S + 1
    assert report() == 0.0


def test_ingress_replicas_merge_into_the_quantiles_of_the_union_of_their_samples():
    """Two ingress replicas: one fast (9 requests at 100 ms TTFT), one slow (one at
    2000 ms). The union's p90 is 100 ms; the worst replica's p90 (2000) or the mean of
    the two (1050) would both be wrong. Goodput is the union's too."""
    fast, slow = (GatewaySignals(ttft_ms=1000, tpot_ms=100, clock=Clock()) for _ in range(2))
    for _ in range(9):
        fast.finished(0.1, 0.02, ok=True)
    slow.finished(2.0, 0.02, ok=True)
    merged = sig.merge_ingress_reports([fast.report(), slow.report()], quantile=0.9)
    assert merged[sig.TTFT_MS] == pytest.approx(100.0, rel=0.05)
    assert merged[sig.TPOT_MS] == pytest.approx(20.0, rel=0.05)
    assert merged[sig.FINISHED] == 10 and merged[sig.GOODPUT] == pytest.approx(0.9)
    # The tenth of the union above p90: the p95 is the slow request.
    assert sig.merge_ingress_reports([fast.report(), slow.report()], quantile=0.95)[sig.TTFT_MS] == \
        pytest.approx(2000.0, rel=0.05)
    # Nothing finished anywhere: no tail, no goodput.
    empty = sig.merge_ingress_reports([GatewaySignals(None, None, clock=Clock()).report()], quantile=0.9)
    assert empty[sig.TTFT_MS] == -1.0 and empty[sig.GOODPUT] == -1.0 and empty[sig.FINISHED] == 0


def test_latency_buckets_read_back_within_their_width():
    b = sig.LatencyBuckets
    for ms in (0.5, 1.0, 3.7, 95.0, 1234.0, 59_000.0):
        counts = [0.0] * b.COUNT
        counts[b.index(ms)] = 1.0
        assert b.quantile_ms(counts, 0.5) == pytest.approx(ms, rel=b.RATIO - 1) or ms < b.LOW_MS
    assert b.quantile_ms([0.0] * b.COUNT, 0.9) is None
