"""The cluster's metric families (`duet_*`) and where they are recorded.

Every process records through one `Recorder`, labelled with its `pool` (gateway,
prefill, decode, aggregated) and `replica`. Inside a Ray worker the recorder writes
to Ray's metrics API (`ray.util.metrics`), so each node's Ray metrics agent exports
the series for Prometheus the way Ray clusters do; the agent adds its `ray_`
namespace (`ray_duet_ttft_seconds`). A recorder given a `prometheus_client`
registry also writes there: the gateway's own `/metrics`, for a single-node user.

Families are declared once, below; a recorder creates an instrument the first time
it records one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Ray takes positive boundaries only; a 0-block overlap falls in the first bucket.
BLOCK_BUCKETS = (0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BASE_LABELS = ("pool", "replica")


@dataclass(frozen=True)
class Family:
    kind: str  # "counter" | "gauge" | "histogram"
    name: str
    doc: str
    labels: tuple[str, ...] = ()  # beyond pool and replica
    buckets: tuple[float, ...] = LATENCY_BUCKETS


def _h(name: str, doc: str, labels: tuple[str, ...] = (), buckets=LATENCY_BUCKETS) -> Family:
    return Family("histogram", name, doc, labels, buckets)


def _c(name: str, doc: str, labels: tuple[str, ...] = ()) -> Family:
    return Family("counter", name, doc, labels)


def _g(name: str, doc: str, labels: tuple[str, ...] = ()) -> Family:
    return Family("gauge", name, doc, labels)


# ---------------------------------------------------------------- gateway (per request)
TTFT = _h("duet_ttft_seconds", "Time to first token, at the gateway")
TPOT = _h("duet_tpot_seconds", "Time per output token after the first, at the gateway")
ITL = _h("duet_itl_seconds", "Gap between streamed chunks, at the gateway")
E2E = _h("duet_e2e_seconds", "End-to-end request latency, at the gateway")
REQUESTS = _c("duet_requests_total", "Finished requests by endpoint and outcome", ("endpoint", "status"))
PROMPT_TOKENS = _c("duet_prompt_tokens_total", "Prompt tokens")
CACHED_TOKENS = _c("duet_cached_prompt_tokens_total", "Prompt tokens served from a KV cache")
OUTPUT_TOKENS = _c("duet_output_tokens_total", "Generated tokens")
IN_FLIGHT = _g("duet_requests_in_flight", "Requests inside the gateway")
MIGRATIONS = _c("duet_migrations_total", "Requests continued on another decode replica after theirs was lost")
MOVES = _c("duet_sequence_moves_total",
           "Decoding sequences handed on, KV and all, to another decode replica when theirs drained")
GOODPUT = _g("duet_goodput_ratio", "Fraction of the last window's finished requests that met the SLO (TTFT and TPOT)")
PREFILL_RETRIES = _c("duet_prefill_retries_total", "Prefill calls retried on another replica after theirs was lost")
PLACEMENTS = _c("duet_disaggregation_decisions_total",
                "Passes of requests by where their prompt was computed (router.disaggregation)", ("where", "reason"))
# ---------------------------------------------------------------- routers (in the gateway process)
# Autoscaling, recorded by the policy in the Serve controller (pool = the scaled pool).
AUTOSCALE_DESIRED = _g("duet_autoscale_desired_replicas", "Replicas the autoscaling policy wants for the pool")
AUTOSCALE_CURRENT = _g("duet_autoscale_current_replicas", "Replicas the pool had when the policy decided")
AUTOSCALE_DECISIONS = _c("duet_autoscale_decisions_total", "Autoscaling changes by direction and reason",
                         ("direction", "reason"))

ROUTER_DECISIONS = _c("duet_router_decisions_total", "Routing decisions by reason; replica = the chosen one",
                      ("reason",))
ROUTER_OVERLAP = _h("duet_router_overlap_blocks", "Prompt blocks cached on the chosen prefill replica",
                    buckets=BLOCK_BUCKETS)
# ---------------------------------------------------------------- replicas
QUEUE_WAIT = _h("duet_queue_wait_seconds", "Time a request waited in a replica's queue before its first step")
RUNNING = _g("duet_running_requests", "Sequences in the running batch")
WAITING = _g("duet_waiting_requests", "Sequences waiting for a slot")
KV_BLOCKS_USED = _g("duet_kv_blocks_used", "KV blocks in use")
KV_BLOCKS_TOTAL = _g("duet_kv_blocks_total", "KV blocks in the pool")
PREEMPTIONS = _c("duet_preemptions_total", "Sequences preempted for lack of KV blocks")
ENGINE_RESTARTS = _c("duet_engine_restarts_total", "Engine cores started in place of one that died")
ENGINE_RESTART_FAILURES = _c("duet_engine_restart_failures_total", "Engine core starts after a loss that failed")
ENGINE_SERVING = _g("duet_engine_serving", "1 while the replica's engine core serves, 0 while it is being replaced")
PREFIX_HIT_TOKENS = _c("duet_prefix_cache_hit_tokens_total", "Prompt tokens found in the replica's own prefix cache")
PREFIX_QUERIED_TOKENS = _c("duet_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache")
TIER_HIT_TOKENS = _c("duet_kv_tier_hit_tokens_total", "Prompt tokens loaded from an LMCache tier", ("tier",))
SPEC_DRAFT_TOKENS = _c("duet_spec_draft_tokens_total", "Speculative draft tokens scored by the model")
SPEC_ACCEPTED_TOKENS = _c("duet_spec_accepted_tokens_total", "Speculative draft tokens the model accepted")
SPEC_VERIFY_STEPS = _c("duet_spec_verify_steps_total",
                       "Request-steps that verified drafts (accepted tokens / these + 1 = tokens per such step)")
FORKS = _c("duet_forked_sequences_total",
           "Choices of an n > 1 request that forked another choice's prompt KV instead of computing or importing it")
# ---------------------------------------------------------------- KV transfer (decode side)
TRANSFER_BYTES = _c("duet_kv_transfer_bytes_total", "KV bytes pulled from prefill", ("backend",))
TRANSFER_SECONDS = _h("duet_kv_transfer_seconds", "Duration of one KV pull", ("backend",))
LEASES_ACTIVE = _g("duet_kv_leases_active", "Prefill KV exports pinned for decode to pull (leases not yet ended)")
LEASES_GRANTED = _c("duet_kv_leases_granted_total", "KV exports a prefill replica leased to decode")
TRANSFER_FAILURES = _c("duet_kv_transfer_failures_total", "KV imports that failed, by reason", ("reason",))

FAMILIES: tuple[Family, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Family))


class Recorder:
    """Owns one process's instruments: Ray's (inside a Ray worker) and, optionally,
    a `prometheus_client` registry's. Recording never raises."""

    def __init__(self, pool: str, replica: str, registry=None, ray_metrics: bool | None = None) -> None:
        self.base = {"pool": pool, "replica": replica}
        self.registry = registry
        self._ray = _in_ray_worker() if ray_metrics is None else ray_metrics
        self._instruments: dict[str, tuple[object | None, object | None]] = {}
        self._lock = threading.Lock()

    def declare(self, *families: Family) -> None:
        """Create these instruments now (a scrape lists them before any value)."""
        for family in families:
            self._instrument(family)

    def observe(self, family: Family, value: float, **labels: str) -> None:
        self._record(family, "observe", value, labels)

    def inc(self, family: Family, value: float = 1.0, **labels: str) -> None:
        if value > 0:  # Ray's counters refuse 0 and negatives
            self._record(family, "inc", value, labels)

    def set(self, family: Family, value: float, **labels: str) -> None:
        self._record(family, "set", value, labels)

    def _record(self, family: Family, op: str, value: float, labels: Mapping[str, str]) -> None:
        try:
            ray_metric, prom_metric = self._instrument(family)
            tags = {**self.base, **{k: str(v) for k, v in labels.items()}}
            if ray_metric is not None:
                getattr(ray_metric, op)(value, tags=tags)
            if prom_metric is not None:
                target = prom_metric.labels(*(tags[k] for k in family.labels)) if family.labels else prom_metric
                getattr(target, op)(value)
        except Exception:  # a metric must never fail a request
            log.debug("recording %s failed", family.name, exc_info=True)

    def _instrument(self, family: Family):
        got = self._instruments.get(family.name)
        if got is None:
            with self._lock:
                got = self._instruments.get(family.name)
                if got is None:
                    got = self._instruments[family.name] = (self._ray_metric(family), self._prom_metric(family))
        return got

    def _ray_metric(self, family: Family):
        if not self._ray:
            return None
        from ray.util import metrics

        tag_keys = (*BASE_LABELS, *family.labels)
        if family.kind == "histogram":
            return metrics.Histogram(family.name, family.doc, boundaries=list(family.buckets), tag_keys=tag_keys)
        cls = metrics.Counter if family.kind == "counter" else metrics.Gauge
        return cls(family.name, family.doc, tag_keys=tag_keys)

    def _prom_metric(self, family: Family):
        """The local registry keeps the gateway's own series only (pool and replica
        are implied): `duet_requests_total{endpoint, status}`, ..."""
        if self.registry is None:
            return None
        import prometheus_client as prom

        name = family.name.removesuffix("_total") if family.kind == "counter" else family.name
        kw = {"labelnames": family.labels, "registry": self.registry}
        if family.kind == "histogram":
            return prom.Histogram(name, family.doc, buckets=family.buckets, **kw)
        return (prom.Counter if family.kind == "counter" else prom.Gauge)(name, family.doc, **kw)


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except Exception:
        return False


class EngineStatsReporter:
    """Turns a replica engine's stats (engine `Engine.stats()` keys, plus the KV
    tier's `kv_tier_<tier>_hit_tokens` and a prefill exporter's `leases_*`) into gauges and counters, every
    `interval_s`, from a daemon thread. Cumulative stats become counter increments."""

    _TIERS = ("cpu", "disk", "redis")

    def __init__(self, recorder: Recorder, read_stats: Callable[[], Mapping], interval_s: float = 2.0) -> None:
        self.recorder = recorder
        self._read = read_stats
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duet-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.report(self._read())
            except Exception:
                log.debug("engine stats report failed", exc_info=True)

    def report(self, s: Mapping) -> None:
        r = self.recorder
        r.set(RUNNING, s.get("num_running", 0))
        r.set(WAITING, s.get("num_waiting", 0))
        total = s.get("kv_blocks_total", 0)
        r.set(KV_BLOCKS_TOTAL, total)
        r.set(KV_BLOCKS_USED, total - s.get("kv_blocks_free", 0))
        self._count(PREEMPTIONS, "num_preemptions", s)
        self._count(PREFIX_HIT_TOKENS, "prefix_cache_hit_tokens", s)
        self._count(PREFIX_QUERIED_TOKENS, "prefix_cache_queried_tokens", s)
        for tier in self._TIERS:
            self._count(TIER_HIT_TOKENS, f"kv_tier_{tier}_hit_tokens", s, tier=tier)
        self._count(SPEC_DRAFT_TOKENS, "spec_draft_tokens", s)
        self._count(SPEC_ACCEPTED_TOKENS, "spec_accepted_tokens", s)
        self._count(SPEC_VERIFY_STEPS, "spec_verify_steps", s)
        self._count(FORKS, "num_forks", s)
        if "engine_serving" in s:  # an engine core that is restarted in place
            r.set(ENGINE_SERVING, s["engine_serving"])
            self._count(ENGINE_RESTARTS, "engine_restarts", s)
            self._count(ENGINE_RESTART_FAILURES, "engine_restart_failures", s)
        if "leases_active" in s:  # a prefill replica's exporter
            r.set(LEASES_ACTIVE, s["leases_active"])
            self._count(LEASES_GRANTED, "leases_granted", s)

    def _count(self, family: Family, key: str, stats: Mapping, **labels: str) -> None:
        value = stats.get(key)
        if value is None:
            return
        last = self._last.get(key, 0)
        # Lower than last time: its source started again from zero (a new engine core).
        self.recorder.inc(family, value - last if value >= last else value, **labels)
        self._last[key] = value

    def close(self) -> None:
        self._stop.set()
