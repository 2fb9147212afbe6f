"""The contract between the pools and the KV-aware routers: each pool server reports,
through Serve's `record_routing_stats`, a `RoutingStats` with every field its router
reads, and it survives Serve's dict on the wire (a replica that reports nothing is
routed blind: as if idle, with every block free)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from decode.server import DecodeServer
from engine.stats import EngineStats
from kvtransfer.messages import RoutingStats
from prefill.server import PrefillServer

pytestmark = pytest.mark.unit

ENGINE_STATS = EngineStats(queued_prefill_tokens=7, num_running=2, num_waiting=1, kv_blocks_free=10,
                           kv_blocks_total=16, request_ids=("a", "b"))


def _fake_replica(serving: bool = True, **extra) -> SimpleNamespace:
    return SimpleNamespace(aengine=SimpleNamespace(stats=ENGINE_STATS, model_fingerprint="fp"),
                           restarts=SimpleNamespace(serving=serving), **extra)


def test_decode_reports_what_the_decode_router_reads():
    stats = RoutingStats.from_wire(
        DecodeServer.record_routing_stats(_fake_replica(events=SimpleNamespace(window=lambda: None))))
    assert stats.num_requests == 3 and stats.request_ids == ("a", "b")
    assert (stats.kv_blocks_free, stats.kv_blocks_total, stats.model_fingerprint) == (10, 16, "fp")


def test_prefill_reports_what_the_prefill_router_reads():
    stats = RoutingStats.from_wire(
        PrefillServer.record_routing_stats(_fake_replica(events=SimpleNamespace(window=lambda: None))))
    assert stats.queued_prefill_tokens == 7 and stats.num_requests == 3
    assert (stats.kv_blocks_free, stats.kv_blocks_total, stats.model_fingerprint) == (10, 16, "fp")


@pytest.mark.parametrize("server", [DecodeServer, PrefillServer])
def test_a_replica_whose_engine_core_is_being_replaced_says_so(server):
    stats = RoutingStats.from_wire(
        server.record_routing_stats(_fake_replica(serving=False, events=SimpleNamespace(window=lambda: None))))
    assert stats.serving is False
    assert RoutingStats.from_wire({}).serving is True  # one that never said reads as serving


def test_a_replica_that_has_not_reported_reads_as_idle_with_blocks_unknown():
    assert RoutingStats.from_wire(None) == RoutingStats()
    assert RoutingStats.from_wire({}).kv_blocks_free is None


def test_fields_a_router_does_not_know_are_ignored():
    # A newer replica may report more than this router reads (a rolling upgrade).
    assert RoutingStats.from_wire({"num_requests": 2, "added_later": 1}).num_requests == 2
