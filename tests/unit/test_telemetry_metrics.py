"""The metric recorder and the engine-stats reporter, against a local registry (no Ray)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from telemetry import metrics
from telemetry.metrics import EngineStatsReporter, Recorder

pytestmark = pytest.mark.unit


def value(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, labels)


def test_families_have_unique_duet_names():
    names = [f.name for f in metrics.FAMILIES]
    assert len(names) == len(set(names)) and all(n.startswith("duet_") for n in names)
    assert all(f.name.endswith("_total") for f in metrics.FAMILIES if f.kind == "counter")


def test_recorder_writes_the_local_registry_and_never_raises():
    reg = CollectorRegistry()
    r = Recorder("gateway", "g#1", registry=reg, ray_metrics=False)
    r.declare(metrics.TTFT)
    assert value(reg, "duet_ttft_seconds_count") == 0
    r.observe(metrics.TTFT, 0.2)
    r.inc(metrics.REQUESTS, endpoint="chat", status="ok")
    r.inc(metrics.OUTPUT_TOKENS, 0)  # Ray refuses 0: skipped, not an error
    r.set(metrics.IN_FLIGHT, 3)
    r.inc(metrics.REQUESTS, status="ok")  # a label missing: dropped quietly
    assert value(reg, "duet_ttft_seconds_count") == 1
    assert value(reg, "duet_requests_total", endpoint="chat", status="ok") == 1
    assert value(reg, "duet_requests_in_flight") == 3


class _Fake(Recorder):
    def __init__(self):
        super().__init__("prefill", "p#1", ray_metrics=False)
        self.seen: list = []

    def _record(self, family, op, value, labels):
        self.seen.append((family.name, op, value, dict(labels)))


def test_reporter_turns_cumulative_stats_into_increments():
    rec = _Fake()
    rep = EngineStatsReporter(rec, dict, interval_s=3600)
    try:
        base = {"num_running": 2, "num_waiting": 1, "kv_blocks_total": 10, "kv_blocks_free": 4,
                "num_preemptions": 1, "prefix_cache_hit_tokens": 32, "kv_tier_cpu_hit_tokens": 256}
        rep.report(base)
        rep.report({**base, "num_preemptions": 1, "prefix_cache_hit_tokens": 48, "kv_tier_cpu_hit_tokens": 256})
    finally:
        rep.close()
    incs = [(n, v, lab) for n, op, v, lab in rec.seen if op == "inc"]
    assert ("duet_preemptions_total", 1, {}) in incs
    assert [v for n, v, _ in incs if n == "duet_prefix_cache_hit_tokens_total"] == [32, 16]
    # no change: no increment
    assert [(v, lab) for n, v, lab in incs if n == "duet_kv_tier_hit_tokens_total"] == [(256, {"tier": "cpu"})]
    sets = {n: v for n, op, v, _ in rec.seen if op == "set"}
    assert sets["duet_kv_blocks_used"] == 6 and sets["duet_running_requests"] == 2
