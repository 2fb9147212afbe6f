"""Prometheus metrics of the gateway: the per-request families of
telemetry/metrics.py, recorded both for Ray's metrics agent (with pool and replica
labels) and in this gateway's own registry (its `/metrics`), plus pool gauges
refreshed from the replicas' stats at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from routing.router import view
from telemetry import metrics
from telemetry.metrics import Recorder

# Declared up front so `/metrics` lists them before the first request.
GATEWAY_FAMILIES = (
    metrics.TTFT, metrics.TPOT, metrics.ITL, metrics.E2E, metrics.REQUESTS, metrics.PROMPT_TOKENS,
    metrics.CACHED_TOKENS, metrics.OUTPUT_TOKENS, metrics.IN_FLIGHT, metrics.MIGRATIONS, metrics.MOVES,
    metrics.PREFILL_RETRIES, metrics.GOODPUT, metrics.PLACEMENTS,
)


class GatewayMetrics:
    """Owns the gateway's registry and recorder; one instance per gateway replica."""

    def __init__(self, replica: str) -> None:
        self.registry = CollectorRegistry()
        self.recorder = Recorder("gateway", replica, registry=self.registry)
        self.recorder.declare(*GATEWAY_FAMILIES)
        self.pool = Gauge(
            "duet_pool_stat", "Pool replica statistics (see `stat`)", ["pool", "replica", "stat"],
            registry=self.registry,
        )
        self.event_cursor = Gauge(
            "duet_router_kv_events_seq",
            "How far this gateway's router has applied each replica's KV event log (compare the replica's "
            "kv_events_seq)", ["pool", "replica"], registry=self.registry,
        )
        self.router_in_flight = Gauge(
            "duet_router_in_flight",
            "Calls this gateway's router sent to each replica and has not seen complete (the load it adds "
            "to the replica's own report)", ["pool", "replica"], registry=self.registry,
        )

    def observe_routers(self) -> None:
        """What this process's routers know of their replicas (at scrape time): how far
        they have applied each one's KV events, and what they have in flight there."""
        self.router_in_flight.clear()  # a replica that left has no series
        for pool in ("prefill", "decode", "aggregated"):
            for replica, end in view.event_cursors(pool).items():
                self.event_cursor.labels(pool, replica).set(end)
            for replica, n in view.in_flight(pool).items():
                self.router_in_flight.labels(pool, replica).set(n)

    def observe_pool(self, pool: str, stats: dict) -> None:
        replica = str(stats.get("replica_id", "?"))
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.pool.labels(pool, replica, k).set(v)
