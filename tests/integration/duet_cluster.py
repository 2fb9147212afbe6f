"""The integration tests' one harness: the session's Ray cluster, the duet app on it,
the cluster configs tests run against, the private Redis servers some of them use,
and polling helpers (no fixed sleeps).

One Ray cluster serves the whole session (`start_ray`/`stop_ray`). One duet app runs
on it at a time: `Deployer` deploys a named config (a key of ``CLUSTERS``, plus
overrides) through its generated Serve config (cluster/serve_config.py), as `duet
serve` does, and hands the same deployment to every test asking for the same config.
conftest.py turns this into fixtures; test modules import the helpers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from cluster.config import ClusterConfig, load_config
from cluster.faults import (  # noqa: F401  (the tests import them from here)
    in_replica,
    kill_engine_core,
    kill_replica,
    live_replicas,
    replica_actor,
)

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("duet.tests")
APP_NAME = "duet"
PORT = 8765
BLOCK_SIZE = 16
# How long a test waits for a replica's stats() (a healthy call takes milliseconds).
STATS_TIMEOUT_S = 15
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
    # The session's one Ray cluster runs Serve's Python proxy in front of the ingress
    # replicas (the replicas that decode, each with the gateway inside): HAProxy is a
    # Ray-cluster-wide switch, and the e2e and multi-node tests run it (`duet serve`'s
    # default). The proxy picks an ingress replica by load alone.
    "gateway.ingress": "proxy",
}

# Where the "traced" cluster exports spans (the test's OTLP sink), and where this
# session's Ray metrics agent serves Prometheus (`start_ray`).
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

# The "aggregated" cluster's speculative decoding, and the "torch"
# cluster's: a draft model, the embedded model drafting for itself (the only checkpoint
# here; every draft is accepted, so each greedy request verifies drafts).
SPECULATIVE = {"method": "ngram", "num_tokens": 4}
DRAFT_SPECULATIVE = {"method": "draft", "draft_model": "smollm2-135m", "num_tokens": 4}

# The "chaos" cluster's private Redis (prefix index and KV tier), which its soak restarts.
CHAOS_REDIS_PORT = 6394
CHAOS_REQUEST_TIMEOUT_S = 90.0
CHAOS_MAX_TOKENS = 12
FUZZ_MAX_TOKENS = 2
AUTO_LOCAL_MAX_TOKENS = 64
AUTO_RESILIENT_LOCAL_MAX_TOKENS = 16
HERMES_TEMPLATE = REPO / "deploy" / "chat_templates" / "hermes_tools.jinja"

# The "autoscaling" cluster's TTFT SLO and capacity profile.
AUTOSCALE_TTFT_SLO_MS = 1500
PROFILE = REPO / "deploy" / "profiles" / "smollm2-135m-cpu.json"

# The KV routing and tier configs: the torch transfer backend, 5 s leases, 16 sequences.
KV_BASE = {"engine.max_num_seqs": 16, "transfer.backend": "torch", "transfer.lease_ttl_s": 5.0}
KV_ROUTING_REDIS_PORT = 6392
TIERS_REDIS_PORT = 6393
TIERS_CHUNK = 128
# Redis answers within 2 s, not the default 0.2: on these 2 cores, shared with the stages
# that run beside integration, a ping once took longer, the tier skipped Redis for that
# prompt's store, and the test waited for chunks that were never written. A stopped
# Redis refuses at once, so the outage test does not wait on this.
TIERS_BASE = {**KV_BASE, "engine.num_kv_blocks": 64, "cache.chunk_size": TIERS_CHUNK,
              "cache.redis_retry_interval_s": 0.5, "cache.redis_timeout_s": 2.0}
# The "tiers-disk" cluster's disk tier; emptied before each deploy of it.
KV_DISK_DIR = Path(tempfile.gettempdir()) / "duet-test-kv-disk"

# In deploy order; tests of one config run together.
CLUSTERS: dict[str, dict] = {
    # No migration or prefill retry: a killed replica's request fails (test_failures.py).
    "nixl": {"gateway.max_migrations": 0, "gateway.prefill_retries": 0},
    # Speculative decoding in the pools that decode: every greedy test of these proves
    # it exact through a served path (test_cluster_api.py). "torch" drafts with a draft
    # model, which prefills each imported prompt itself.
    "torch": {"transfer.backend": "torch", "engine.speculative": DRAFT_SPECULATIVE},
    "aggregated": {"mode": "aggregated", "engine.speculative": SPECULATIVE},
    # API keys, one request in flight and 1,100 tokens a minute per key, 8 KiB bodies,
    # 10 s per request, 40 header fields, one CORS origin, each key's KV its own.
    "secure": {
        "gateway.api_keys_file": str(KEYS_FILE),
        "gateway.cache_isolation": "per_key",
        "gateway.max_in_flight_per_key": 1,
        "gateway.tokens_per_minute_per_key": TOKENS_PER_MINUTE,
        "gateway.max_body_bytes": MAX_BODY_BYTES,
        "gateway.request_timeout_s": REQUEST_TIMEOUT_S,
        "gateway.max_headers": 40,
        "gateway.cors_allow_origins": [CORS_ORIGIN],
    },
    # Every span to the session's OTLP sink, exported within 0.2 s; short leases (the
    # TTL path) and a decode pool too small for long prompts (the reject path, traced).
    "traced": {
        "telemetry.tracing": True,
        "telemetry.otlp_endpoint": f"http://127.0.0.1:{OTLP_PORT}",
        "telemetry.export_delay_ms": 200,
        "transfer.lease_ttl_s": 3.0,
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
    # The KV-aware prefill router (test_kv_routing.py): two prefill replicas and the
    # Redis prefix index, load reports every 0.2 s.
    "kv-routing": {
        **KV_BASE,
        "prefill.replicas": 2,
        "router.prefix_index": "redis",
        "router.redis_url": f"redis://127.0.0.1:{KV_ROUTING_REDIS_PORT}/0",
        "router.index_key_prefix": "duet:test-routing",
        "router.imbalance_threshold": 48,
        "router.stats_period_s": 0.2,
    },
    # LMCache tiers in the prefill pool (test_lmcache_tiers.py), 128-token chunks and 64
    # blocks per pool (two 900-token prompts evict any earlier one): CPU and Redis ...
    "tiers": {
        **TIERS_BASE,
        "cache.cpu_bytes": 256 << 20,
        "cache.redis_url": f"redis://127.0.0.1:{TIERS_REDIS_PORT}/0",
    },
    # ... or disk alone (it outlives a replica), with the prefill engine and its tier on
    # a thread of the replica (as on a GPU); everywhere else they run in a child process.
    "tiers-disk": {**TIERS_BASE, "cache.disk_path": str(KV_DISK_DIR), "cache.disk_bytes": 1 << 30,
                   "prefill.engine_process": False},
    # The fuzzer's (test_gateway_fuzz.py): 128-token contexts, at most 2 completion tokens
    # and 2 choices, a 90 s request deadline. Most fuzzed bodies that validate ask for
    # the most tokens allowed, and generating them was most of the fuzzer's time.
    # `router.disaggregation: auto` (prompts of <= 64 tokens prefilled on decode), so the
    # fuzzer drives both placements, and test_disaggregation_auto.py checks each.
    "fuzz": {
        "engine.max_model_len": 128,
        "router.disaggregation": {"mode": "auto", "max_local_prompt_tokens": AUTO_LOCAL_MAX_TOKENS},
        "gateway.request_timeout_s": CHAOS_REQUEST_TIMEOUT_S,
        "gateway.max_tokens": FUZZ_MAX_TOKENS,
        "gateway.max_n": 2,
    },
    # Two replicas per pool, so a lost one can be survived (tests kill replicas: last).
    "resilient": {"prefill.replicas": 2, "decode.replicas": 2},
    # `auto` with two decode replicas (test_auto_migration.py kills one): a prompt of a
    # few token ids is prefilled on decode, so its decode replica holds the only copy of
    # its KV when it dies.
    # Its chat template renders tools the Hermes way (test_native_tools.py); its other
    # test sends completions, which no template touches.
    "auto-resilient": {
        "decode.replicas": 2,
        "router.disaggregation": {"mode": "auto", "max_local_prompt_tokens": AUTO_RESILIENT_LOCAL_MAX_TOKENS},
        "gateway.chat_template": str(HERMES_TEMPLATE),
    },
    # The soak's: two replicas per pool, the Redis prefix index, CPU and
    # Redis KV tiers (16-token chunks: the prompts are short), a 90 s request deadline,
    # 128-token contexts, at most 12 completion tokens and 2 choices.
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
        "gateway.max_n": 2,
    },
}


def cluster_config(name: str, overrides: dict | None = None) -> ClusterConfig:
    """The named config, with `overrides` (dotted keys) on top."""
    if name == "secure":
        KEYS_FILE.write_text("\n".join(API_KEYS) + "\n")
    return load_config(None, {**BASE, **CLUSTERS[name], **(overrides or {})})


def redis_ports(cfg: ClusterConfig) -> list[int]:
    """Ports of the private Redis servers `cfg` uses (prefix index, KV tier)."""
    urls = [cfg.cache.redis_url, cfg.router.redis_url if cfg.router.prefix_index == "redis" else None]
    return sorted({urlparse(u).port for u in urls if u})


class RedisServer:
    """A private Redis (scripts/redis.sh) on its own port, so a test may stop and start
    it without disturbing another config's."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.env = dict(os.environ, DUET_REDIS_PORT=str(port), DUET_REDIS_DIR=str(directory))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def run(self, cmd: str) -> subprocess.CompletedProcess:
        """`scripts/redis.sh cmd` (start and stop are idempotent)."""
        return subprocess.run([str(REPO / "scripts" / "redis.sh"), cmd], env=self.env,
                              capture_output=True, text=True, timeout=120)

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()


def start_ray() -> None:
    """The session's Ray cluster (a new one, never one a `ray start` left) and Serve's
    proxy on `PORT`."""
    from ray import serve

    from cluster.app import CONTROLLER_ENV, REPLICA_ENV
    from cluster.ray_start import init_local

    init_local(
        num_cpus=4,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": REPLICA_ENV},
        # Replicas' metrics reach this node's agent every second (default 10 s).
        _metrics_export_port=METRICS_PORT,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    # Serve's controller loop as `duet serve` runs it (cluster/app.py CONTROLLER_ENV).
    serve.start(http_options={"host": "127.0.0.1", "port": PORT},
                controller_options={"runtime_env": {"env_vars": CONTROLLER_ENV}})


def stop_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


class Deployer:
    """Owns the session's duet app: deploys a config when the app runs another, and
    hands the running one to every test of the same config. Redeploys cost model loads
    (this machine has 2 cores), so conftest.py orders tests by config."""

    def __init__(self) -> None:
        self.current: Duet | None = None
        self._deployed_at: float | None = None
        # (config name, seconds) per deploy or resize, for the session's time report.
        self.deploys: list[tuple[str, float]] = []

    def __call__(self, name: str, overrides: dict | None = None) -> Duet:
        cfg = cluster_config(name, overrides)
        if self.current is not None and self.current.cfg == cfg and self._untouched():
            return self.current
        from cluster.serve_cli import wait_ready
        from cluster.serve_config import deploy, without_fixed_sizes

        started = time.monotonic()
        resize_only = (self.current is not None and self._untouched()
                       and without_fixed_sizes(self.current.cfg) == without_fixed_sizes(cfg))
        if self.current is not None:
            self.current.close()
        self.current = None
        drop_cached_handles()
        if cfg.cache.disk_path and not resize_only:  # new replicas start with an empty disk tier
            shutil.rmtree(cfg.cache.disk_path, ignore_errors=True)
        deploy(cfg, timeout_s=300)  # the generated Serve config, as `duet serve` deploys it
        url = f"http://127.0.0.1:{PORT}"
        wait_ready(url, timeout=240)
        duet = Duet(name, cfg, url)
        self.wait_settled(duet)
        self._deployed_at = _app_details()["last_deployed_time_s"]
        self.current = duet
        self.deploys.append((name, time.monotonic() - started))
        return duet

    def _untouched(self) -> bool:
        """Whether the app is still the one this deployer deployed. A test that
        redeploys it itself (with `serve.run`) leaves another, even when it restores
        the config, and more so when it fails first."""
        app = _app_details()
        return app is not None and app["source"] == "declarative" and app["last_deployed_time_s"] == self._deployed_at

    @staticmethod
    def wait_settled(d: Duet) -> None:
        """After a redeploy the old replicas may still answer; wait until only the new
        config's run: each fixed-size pool at its replica count, nothing stopping, and
        stats from a replica with the new config's KV pool."""
        for pool_name, pool in d.cfg.pools().items():
            if pool.scaling == "fixed":
                wait_replicas(pool_name, pool.replicas, exact=True)
        expect = d.cfg.decode.num_kv_blocks if d.cfg.mode == "disaggregated" else None
        pool = "decode" if d.cfg.mode == "disaggregated" else "aggregated"
        total = expect or d.cfg.engine.num_kv_blocks
        wait_for(lambda: d.stats(pool)["kv_blocks_total"] == total, 60, what=f"{pool} with {total} blocks")


def drop_cached_handles() -> None:
    """Shut down the handles Serve's client caches in this process. A handle builds its
    request router once, from the deployment's router kwargs at its first call, and
    keeps it across redeploys: a handle cached under an earlier config would route by
    that config's policy and prefix index."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    shut_down(list(client.handle_cache.values()))
    client.handle_cache.clear()


def shut_down(handles: list) -> None:
    """Shut handles down, waiting at most a few seconds: `shutdown()` waits on the
    router's event loop, and a test must not hang on a router that is stuck (it is
    dropped either way)."""
    if not handles:
        return
    done = threading.Thread(target=lambda: [h.shutdown() for h in handles], name="shut-down-handles", daemon=True)
    done.start()
    done.join(timeout=10)
    if done.is_alive():
        log.warning("handle shutdown still waiting after 10 s; dropped")


def fresh_handle(deployment: str, attempts: int = 3, timeout_s: float = 10.0):
    """A handle with its own new request router (`serve.get_deployment_handle` returns
    the client's cached handle, whose router may have seen other tests' requests),
    returned once that router has its deployment's config and so can place a call.

    Why wait, and why a new handle if it never comes: a new router learns the config
    from a long poll of its own, which Serve stops as soon as the process's shared long
    poll delivers anything for the deployment. When the shared one delivers the replica
    set first, the own poll's answer is dropped, and the shared one (already past that
    config's version) never sends it: the router can never build its request router
    and holds every call (Ray 2.60 `AsyncioRouter`, `LongPollClient.stop`). Rare, and a
    new handle is a new race."""
    from ray.serve.handle import DeploymentHandle

    for _ in range(attempts):
        handle = DeploymentHandle(deployment, APP_NAME)
        handle._init()
        configured = handle._router._asyncio_router._request_router_initialized
        try:
            wait_for(configured.is_set, timeout_s, interval=0.05,
                     what=f"a new {deployment} handle's router to get its config")
            return handle
        except AssertionError:
            log.warning("a new %s handle's router never got its config: %s; trying a new one",
                        deployment, describe_router(handle))
            shut_down([handle])
    raise AssertionError(f"{attempts} new {deployment} handles never got their deployment's config")


def describe_router(handle) -> str:
    """What a driver-side handle's router knows (Serve internals, best effort): whether
    its request router is built, the replicas it routes to, the requests waiting to be
    placed, and where its event loop thread is, for a post-mortem of a call that was
    never placed."""
    import sys
    import traceback

    parts: list[str] = []
    try:
        router = getattr(getattr(handle, "_router", None), "_asyncio_router", None)
        if router is None:
            return "no router built"
        request_router = router._request_router
        parts.append(f"request router built={router._request_router_initialized.is_set()}")
        parts.append(f"deployment available={router._deployment_available}")
        if request_router is not None:
            parts.append(f"replicas={sorted(str(r) for r in request_router._replica_id_set)}")
            parts.append(f"waiting to be placed={len(request_router._pending_requests_to_fulfill)}")
            parts.append(f"routing tasks={len(request_router._routing_tasks)}")
        loop_thread = getattr(router._event_loop, "_thread_id", None)
        frame = sys._current_frames().get(loop_thread) if loop_thread else None
        if frame is not None:
            parts.append("loop thread at: " + " <- ".join(
                f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
                for f in reversed(traceback.extract_stack(frame)[-6:])))
        parts.append(f"threads={len(threading.enumerate())}")
    except Exception as e:  # a diagnostic must not hide the failure it describes
        parts.append(f"(could not read more: {e!r})")
    return "; ".join(parts)


def _app_details() -> dict | None:
    """Serve's details of the duet app (None if absent)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()["applications"].get(APP_NAME)


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
        """One handle per deployment for the app's life, owned by this object (not the
        client's cache): a new handle sets up its router on its first call, which makes
        polling loops slow."""
        if deployment not in self._handles:
            self._handles[deployment] = fresh_handle(deployment)
        return self._handles[deployment]

    def stats(self, deployment: str) -> dict:
        """One replica's `stats()`. A call the handle cannot place on a replica within
        the timeout raises with the handle's router state, and the next call uses a new
        handle (a new router), so a router stuck in this driver costs one timeout."""
        handle = self.handle(deployment)
        try:
            return handle.stats.remote().result(timeout_s=STATS_TIMEOUT_S)
        except TimeoutError as e:
            self._handles.pop(deployment, None)
            raise TimeoutError(f"{deployment}.stats() unanswered after {STATS_TIMEOUT_S} s ({e}); "
                               f"this driver's router: {describe_router(handle)}") from None

    def close(self) -> None:
        """Shut down this object's handles."""
        shut_down(list(self._handles.values()))
        self._handles.clear()

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


def engine_restarts(replica_id: str) -> dict[str, float]:
    """One replica's engine core restart counters (`CoreRestarts.stats`): of its pool
    server (the prefill deployment's instance, or the one inside a gateway)."""
    return in_replica(replica_id, lambda served: getattr(served, "local", served).restarts.stats())


def wait_replicas(pool: str, n: int, timeout: float = 240, exact: bool = False) -> None:
    """`pool` healthy with `n` running replicas (`exact`: and no other, e.g. stopping)."""
    from ray import serve

    def healthy() -> bool:
        d = serve.status().applications[APP_NAME].deployments[pool]
        running = d.replica_states.get("RUNNING", 0)
        return d.status == "HEALTHY" and running == n and (not exact or sum(d.replica_states.values()) == n)

    wait_for(healthy, timeout, interval=1, what=f"{n} healthy {pool} replicas{' and no other' if exact else ''}")


def kill_replicas(pool: str) -> list[str]:
    """Kill every live replica of `pool` (Serve starts new ones); returns their ids."""
    victims = sorted(live_replicas(pool))
    for replica_id in victims:
        kill_replica(replica_id)
    return victims


def wait_new_replica(duet: Duet, pool: str, old: set[str], timeout: float = 180) -> str:
    """The id of a replica of `pool` that is not one of `old`, once it answers stats."""
    def new() -> str | None:
        rid = duet.stats(pool)["replica_id"]
        return rid if rid not in old else None

    return wait_for(new, timeout, interval=0.5, what=f"a {pool} replica other than {sorted(old)}")


def prompt(n: int, seed: int) -> list[int]:
    """`n` token ids drawn from `seed`: distinct seeds, distinct prefixes."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def complete(duet: Duet, ids: list[int], max_tokens: int = 8, timeout: float = 120, **fields) -> dict:
    """One greedy completion of the token ids `ids` (the response body); `fields` are
    more request fields (e.g. `cache_salt`)."""
    body = json.dumps({"model": "smollm2-135m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       **fields}).encode()
    req = urllib.request.Request(f"{duet.base_url}/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def cached_tokens(resp: dict) -> int:
    """Prompt tokens a completion took from a cache (its usage's cached_tokens)."""
    details = resp["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def gateway_counter(duet: Duet, name: str, **labels: str) -> float:
    """The sum of a series' samples (every label set that has `labels`) over the
    registries of every live ingress replica (each decode or aggregated replica runs a
    gateway, and a /metrics scrape through the proxy reads one of them only)."""
    import ray

    def registry_text(gateway) -> str:  # on the replica: its gateway's registry, as /metrics gives it
        from prometheus_client import generate_latest
        return generate_latest(gateway.gateway_metrics.registry).decode()

    pool = "aggregated" if duet.cfg.mode == "aggregated" else "decode"
    texts = []
    for replica in live_replicas(pool):
        try:
            texts.append(in_replica(replica, registry_text))
        except (ValueError, ray.exceptions.RayActorError):  # it stopped since it was listed
            continue
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for text in texts for line in text.splitlines()
               if (line.startswith(name + " ") and not wanted)
               or (line.startswith(name + "{") and all(w in line for w in wanted)))


def wait_baseline(duet: Duet, pool: str, timeout: float = 120) -> dict[str, dict]:
    """Every live replica of `pool` seen idle: nothing running or waiting, all KV blocks
    free, no lease. Stats calls land on a random replica; poll until each has answered."""
    keys = ("num_running", "num_waiting", "kv_blocks_free", "kv_blocks_total", "leases_active",
            "import_blocks_held", "import_blocks_reclaimed", "leases_expired", "leases_granted")
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


def ongoing_requests(pool: str) -> dict[str, int]:
    """Calls in flight on each live replica of `pool`, by Serve's own count asked of
    each replica's actor directly (a stats call through Serve goes to the least busy
    replica, never the serving one)."""
    import ray

    return {r: ray.get(replica_actor(r).get_num_ongoing_requests.remote(), timeout=10) for r in live_replicas(pool)}


def serving_replica(pool: str) -> str | None:
    """The one replica of `pool` with a call in flight; None unless exactly one is busy."""
    busy = [r for r, n in ongoing_requests(pool).items() if n > 0]
    return busy[0] if len(busy) == 1 else None
