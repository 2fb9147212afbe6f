"""The contract between the pools and the KV-aware routers: each pool server reports,
through Serve's `record_routing_stats`, every field its router reads (a replica that
reports nothing is routed blind: as if idle, with every block free)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from decode.server import DecodeServer
from prefill.server import PrefillServer

pytestmark = pytest.mark.unit

ENGINE_STATS = {"queued_prefill_tokens": 7, "num_running": 2, "num_waiting": 1, "kv_blocks_free": 10,
                "kv_blocks_total": 16, "request_ids": ["a", "b"]}


def _fake_replica(**extra) -> SimpleNamespace:
    engine = SimpleNamespace(model_fingerprint="fp")
    return SimpleNamespace(aengine=SimpleNamespace(stats=ENGINE_STATS, engine=engine), **extra)


def test_decode_reports_what_the_decode_router_reads():
    stats = DecodeServer.record_routing_stats(_fake_replica())
    # routing/router/serve_routers.py: DecodeRouter reads load and free blocks.
    assert stats["num_running"] == 3 and stats["request_ids"] == ["a", "b"]
    assert (stats["kv_blocks_free"], stats["kv_blocks_total"]) == (10, 16)


def test_prefill_reports_what_the_prefill_router_reads():
    stats = PrefillServer.record_routing_stats(_fake_replica(events=SimpleNamespace(window=lambda: None)))
    assert stats["queued_prefill_tokens"] == 7 and stats["num_running"] == 3
    assert (stats["kv_blocks_free"], stats["kv_blocks_total"], stats["model_fingerprint"]) == (10, 16, "fp")
