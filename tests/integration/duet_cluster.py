"""What the integration tests share about a deployed duet app: the configs they
run against, a handle on the app, and polling helpers (no fixed sleeps)."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.config import ClusterConfig, load_config

APP_NAME = "duet"
PORT = 8765
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 256
# SmolLM2-135M fp32: layers x (K, V) x block_size x kv_heads x head_dim x 4 bytes.
BYTES_PER_BLOCK = 30 * 2 * BLOCK_SIZE * 3 * 64 * 4

BASE = {
    "engine.dtype": "float32",
    "engine.device": "cpu",
    "engine.num_kv_blocks": NUM_KV_BLOCKS,
    "engine.max_model_len": 1024,
    "prefill.threads": 1,
    "decode.threads": 1,
    "aggregated.threads": 1,
    "gateway.port": PORT,
}

# Where the "traced" cluster exports spans (the test's OTLP sink), and where this
# session's Ray metrics agent serves Prometheus (conftest.py's ray.init).
OTLP_PORT = 14318
METRICS_PORT = 18765
# The "traced" cluster's decode pool: 16 blocks (256 tokens), so a long prompt's
# import is refused (a failed transfer on its trace and in its metrics).
TRACED_DECODE_BLOCKS = 16

# The "secure" cluster's API keys, in the file its gateway reads.
API_KEYS = ("sk-duet-test-a", "sk-duet-test-b", "sk-duet-test-c", "sk-duet-test-d")
KEYS_FILE = Path(tempfile.gettempdir()) / "duet-test-api-keys"
TOKENS_PER_MINUTE = 1100
REQUEST_TIMEOUT_S = 10.0
CORS_ORIGIN = "https://app.example"
MAX_BODY_BYTES = 8192

# The "chaos" cluster's private Redis (prefix index and KV tier), which its soak restarts.
CHAOS_REDIS_PORT = 6394
CHAOS_REQUEST_TIMEOUT_S = 90.0
CHAOS_MAX_TOKENS = 24

# The "autoscaling" cluster's TTFT SLO and capacity profile.
AUTOSCALE_TTFT_SLO_MS = 1500
PROFILE = Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "smollm2-135m-cpu.json"

# In deploy order; tests of one config run together.
CLUSTERS: dict[str, dict] = {
    # No migration or prefill retry: a killed replica's request fails (test_failures.py).
    "nixl": {"gateway.max_migrations": 0, "gateway.prefill_retries": 0},
    "torch": {"transfer.backend": "torch"},
    "aggregated": {"mode": "aggregated"},
    # Short leases (TTL path) and a decode pool too small for long prompts (reject path).
    "small": {"transfer.lease_ttl_s": 3.0, "decode.num_kv_blocks": 4},
    # API keys, one request in flight and 1,100 tokens a minute per key, 8 KiB bodies,
    # 10 s per request, 40 header fields, one CORS origin.
    "secure": {
        "gateway.api_keys_file": str(KEYS_FILE),
        "gateway.max_in_flight_per_key": 1,
        "gateway.tokens_per_minute_per_key": TOKENS_PER_MINUTE,
        "gateway.max_body_bytes": MAX_BODY_BYTES,
        "gateway.request_timeout_s": REQUEST_TIMEOUT_S,
        "gateway.max_headers": 40,
        "gateway.cors_allow_origins": [CORS_ORIGIN],
    },
    # Every span to the test's OTLP sink, exported within 0.2 s.
    "traced": {
        "telemetry.tracing": True,
        "telemetry.otlp_endpoint": f"http://127.0.0.1:{OTLP_PORT}",
        "telemetry.export_delay_ms": 200,
        "decode.num_kv_blocks": TRACED_DECODE_BLOCKS,
    },
    # The goodput policy on prefill (1-2 replicas) and decode (held at 1), reacting
    # within seconds: signals every second, 1 s up and 10 s down windows, 5 s warm-up.
    "autoscaling": {
        "slo": {"ttft_ms": AUTOSCALE_TTFT_SLO_MS, "tpot_ms": 500},
        "prefill.autoscaling": {"policy": "goodput", "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1,
                                "downscale_delay_s": 10, "warmup_s": 5, "signal_interval_s": 1,
                                "profile": str(PROFILE)},
        "decode.autoscaling": {"policy": "goodput", "min_replicas": 1, "max_replicas": 1, "signal_interval_s": 1,
                               "profile": str(PROFILE)},
    },
    # Two replicas per pool, so a lost one can be survived (tests kill replicas: last).
    "resilient": {"prefill.replicas": 2, "decode.replicas": 2},
    # The soak's and the fuzzer's: two replicas per pool, the Redis prefix index, CPU and
    # Redis KV tiers (16-token chunks: the prompts are short), a 90 s request deadline,
    # 128-token contexts and at most 24 completion tokens (so fuzzed requests stay short).
    "chaos": {
        "engine.max_model_len": 128,
        "prefill.replicas": 2,
        "decode.replicas": 2,
        "router.prefix_index": "redis",
        "router.redis_url": f"redis://127.0.0.1:{CHAOS_REDIS_PORT}/0",
        "cache.cpu_bytes": 64 << 20,
        "cache.redis_url": f"redis://127.0.0.1:{CHAOS_REDIS_PORT}/1",
        "cache.chunk_size": BLOCK_SIZE,
        "gateway.request_timeout_s": CHAOS_REQUEST_TIMEOUT_S,
        "gateway.max_tokens": CHAOS_MAX_TOKENS,
    },
}


def cluster_config(name: str) -> ClusterConfig:
    if name == "secure":
        KEYS_FILE.write_text("\n".join(API_KEYS) + "\n")
    return load_config(None, {**BASE, **CLUSTERS[name]})


@dataclass
class Duet:
    """A deployed duet app: its config, URL and Serve handles."""

    name: str
    cfg: ClusterConfig
    url: str
    _handles: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def handle(self, deployment: str):
        """One handle per deployment for the app's life: a new handle sets up its
        router on its first call, which makes polling loops slow."""
        if deployment not in self._handles:
            from ray import serve

            self._handles[deployment] = serve.get_deployment_handle(deployment, app_name=APP_NAME)
        return self._handles[deployment]

    def stats(self, deployment: str) -> dict:
        return self.handle(deployment).stats.remote().result(timeout_s=30)

    def pool_names(self) -> list[str]:
        return list(self.cfg.pools())


def wait_for(pred: Callable[[], object], timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    """Poll ``pred`` until it returns a truthy value; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # a replica being replaced
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def blocks_for(num_tokens: int) -> int:
    return math.ceil(num_tokens / BLOCK_SIZE)


def wait_idle(duet: Duet, timeout: float = 20.0) -> None:
    """Every pool back at baseline: no leases, nothing running, every KV block free
    (cached prefix blocks count as free: they are evictable)."""
    seen: dict = {}

    def idle() -> bool:
        ok = True
        for pool in duet.pool_names():
            s = seen[pool] = duet.stats(pool)
            ok &= s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
            ok &= s.get("leases_active", 0) == 0
        return ok

    try:
        wait_for(idle, timeout, what="every pool idle with all KV blocks free")
    except AssertionError as e:
        keys = ("num_running", "num_waiting", "kv_blocks_free", "kv_blocks_total", "leases_active")
        detail = {p: {k: s.get(k) for k in keys} for p, s in seen.items()}
        raise AssertionError(f"{e}; last stats: {detail}") from None


def kill_replica(replica_id: str) -> None:
    """Kill one Serve replica's actor (`decode#abc` → SERVE_REPLICA::duet#decode#abc); Serve replaces it."""
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{replica_id}", namespace="serve"), no_restart=True)


def live_replicas(pool: str) -> set[str]:
    """Replica ids (`decode#abc`) of `pool` whose actors are alive."""
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#"
    return {a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"{prefix}{pool}#")}


def wait_replicas(pool: str, n: int, timeout: float = 240) -> None:
    """`pool` healthy with `n` running replicas."""
    from ray import serve

    def healthy() -> bool:
        d = serve.status().applications[APP_NAME].deployments[pool]
        return d.status == "HEALTHY" and d.replica_states.get("RUNNING", 0) == n

    wait_for(healthy, timeout, interval=1, what=f"{n} healthy {pool} replicas")


def gateway_counter(duet: Duet, name: str) -> float:
    """The sum of a series' samples on the gateway's /metrics (every label set)."""
    import httpx

    text = httpx.get(f"{duet.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def wait_baseline(duet: Duet, pool: str, timeout: float = 120) -> dict[str, dict]:
    """Every live replica of `pool` seen idle: nothing running or waiting, all KV blocks
    free, no lease. Stats calls land on a random replica; poll until each has answered."""
    keys = ("num_running", "num_waiting", "kv_blocks_free", "kv_blocks_total", "leases_active",
            "import_blocks_held", "import_blocks_reclaimed", "leases_expired")
    idle: dict[str, dict] = {}
    last: dict[str, dict] = {}

    def all_idle() -> bool:
        s = duet.stats(pool)
        mine = last[s["replica_id"]] = {k: s.get(k, 0) for k in keys}
        if mine["num_running"] == mine["num_waiting"] == mine["leases_active"] == mine["import_blocks_held"] == 0 \
                and mine["kv_blocks_free"] == mine["kv_blocks_total"]:
            idle[s["replica_id"]] = mine
        else:
            idle.pop(s["replica_id"], None)
            last[s["replica_id"]] = s
        return live_replicas(pool) <= idle.keys()

    try:
        wait_for(all_idle, timeout, interval=0.1, what=f"every {pool} replica back at baseline")
    except AssertionError as e:
        raise AssertionError(f"{e}; live {sorted(live_replicas(pool))}, last stats {last}") from None
    return idle
