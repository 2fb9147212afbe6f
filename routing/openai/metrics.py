"""Prometheus metrics of the gateway (`duet_*`), plus pool gauges refreshed from the
replicas' stats at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    """Owns the gateway's registry; one instance per gateway replica."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("duet_requests", "Requests by endpoint and outcome", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("duet_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("duet_tpot_seconds", "Time per output token after the first", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("duet_itl_seconds", "Gap between streamed chunks", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("duet_e2e_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("duet_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("duet_cached_prompt_tokens", "Prompt tokens served from a KV cache", registry=r)
        self.output_tokens = Counter("duet_output_tokens", "Generated tokens", registry=r)
        self.in_flight = Gauge("duet_requests_in_flight", "Requests inside the gateway", registry=r)
        self.pool = Gauge("duet_pool_stat", "Pool replica statistics (see `stat`)", ["pool", "replica", "stat"], registry=r)

    def observe_pool(self, pool: str, stats: dict) -> None:
        replica = str(stats.get("replica_id", "?"))
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.pool.labels(pool, replica, k).set(v)
