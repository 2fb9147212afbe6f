"""Prometheus metrics of the gateway: the per-request families of
telemetry/metrics.py, recorded both for Ray's metrics agent (with pool and replica
labels) and in this gateway's own registry (its `/metrics`), plus pool gauges
refreshed from the replicas' stats at scrape time."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Gauge

from engine.stats import EngineStats
from routing.router import view
from telemetry import metrics
from telemetry.metrics import Recorder

# The replica stats `duet_pool_stat` carries (its `stat` label), by pool: the engine's
# typed snapshot (every number of `EngineStats`, so a renamed field is renamed here),
# and what the replica adds around it. Only these are gauged: a stat a replica stops
# reporting fails tests/integration/test_cluster_api.py instead of leaving dashboards.
ENGINE_STATS = tuple(f.name for f in dataclasses.fields(EngineStats) if f.type in ("int", "float", int, float))
REPLICA_STATS = ("engine_restarts", "engine_restart_failures", "engine_serving", "kv_events_cached_blocks",
                 "kv_events_seq")
POOL_STATS: dict[str, tuple[str, ...]] = {
    "prefill": (*ENGINE_STATS, *REPLICA_STATS, "leases_active", "leases_granted", "leases_released",
                "leases_rejected", "leases_expired"),
    "decode": (*ENGINE_STATS, "engine_restarts", "engine_restart_failures", "engine_serving", "transfer_count",
               "transfer_failures", "transfer_bytes", "transfer_seconds", "transfer_blocks", "imports",
               "import_rejects", "import_failures", "import_recomputes", "imports_waiting", "import_blocks_held",
               "import_blocks_reclaimed", "leases_active", "moves_out"),
    "aggregated": (*ENGINE_STATS, *REPLICA_STATS),
}

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
        """Gauge the pool's `POOL_STATS` from one replica's stats (a decode pool without
        KV events has no `kv_events_*`: those it does not report are skipped)."""
        replica = str(stats.get("replica_id", "?"))
        for k in POOL_STATS[pool]:
            v = stats.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.pool.labels(pool, replica, k).set(v)
