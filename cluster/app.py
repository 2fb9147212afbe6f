"""Builds the Ray Serve application from a `ClusterConfig`: the pools as
deployments, the one that decodes as the HTTP ingress with the gateway inside each of
its replicas, each sized from its pool config."""

from __future__ import annotations

import os

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from cluster.config import ClusterConfig, PoolConfig
from engine.engine import expected_model_fingerprint
from kvtransfer.events.config import PrefixIndexConfig
from prefill.server import PrefillServer
from routing.openai.access import KEYS_ENV
from routing.openai.gateway import Gateway
from routing.router.ingress import IngressRouter

# Ray Serve's own cost per request on few cores: a replica runs its user code, and a
# handle its router, on the replica's event loop rather than on threads of their own
# (two of the settings RAY_SERVE_THROUGHPUT_OPTIMIZED makes, without its direct ingress),
# and Serve flushes its cached metrics every second rather than every 0.1 s. On the
# chaos soak this cut the cluster's CPU by 6-9% and the soak's time by 6-18%
# (docs/benchmarks.md, "Serve's event loops"). Serve reads them when its modules are
# imported, so they travel in a process's environment. A driver that calls a handle
# outside an event loop must not take them: its router would have no loop to run on.
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
# Serve's controller runs its control loop every 0.25 s rather than every 0.1 s. On a
# node where an engine fills the cores, every share of a core that another process
# takes costs the engine up to that share of its speed (docs/benchmarks.md, "Serving
# efficiency"); the loop, with the GCS calls it makes, took
# ~5% of a core at 0.1 s and ~2.7% at 0.25 s. The loop is also when the controller
# gathers the replicas' routing stats (`router.stats_period_s`, 0.25 s): they now reach
# the routers every 0.25-0.5 s instead of every ~0.3 s, and up to 0.15 s later; each
# router counts its own picks meanwhile. A dead replica or a scaling decision is acted
# on up to 0.15 s later too. Only the controller reads it: `serve.start` passes it in
# `controller_options`, and the chart sets it on the Ray pods.
CONTROLLER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25"}
# Ray starts its workers at nice 15, to keep its own daemons responsive when tasks fill
# the CPU. A replica and its engine core are a node's main work: at nice 15 any ordinary
# process on the node (a sidecar, a log shipper, a neighbour's busy loop) takes ~97% of
# a core they share. Ray's job supervisor opts out the same way.
# Every replica computes block hashes and LMCache keys the same way (PYTHONHASHSEED);
# LMCache would log every chunk it stores at INFO, a line per prompt per replica.
REPLICA_ENV = {"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
               "LMCACHE_LOG_LEVEL": "WARNING", "RAY_worker_niceness": "0", **SERVE_ENV}


def _options(name: str, pool: PoolConfig, drain_at_least_s: float = 0.0) -> dict:
    """Serve options of one pool. Stopping a replica drains it: Serve stops routing to
    it and waits for its calls (streams) to end, then the replica's own shutdown waits
    for what outlives them (a prefill replica's leases: `drain_at_least_s`)."""
    opts: dict = {
        "name": name,
        "ray_actor_options": {"num_cpus": pool.num_cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
        "max_ongoing_requests": pool.max_ongoing_requests,
        "health_check_period_s": 2,
        "health_check_timeout_s": 10,
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": max(pool.drain_timeout_s, drain_at_least_s),
    }
    if pool.num_gpus:
        opts["ray_actor_options"]["num_gpus"] = pool.num_gpus
    if pool.resources():
        opts["ray_actor_options"]["resources"] = pool.resources()
    a = pool.autoscaling
    if pool.scaling == "fixed":
        opts["num_replicas"] = pool.replicas
    elif pool.scaling == "queue":
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas,
            initial_replicas=pool.initial_replicas(),
            max_replicas=a.max_replicas,
            target_ongoing_requests=a.target_ongoing_requests,
            upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s,
        )
    else:
        opts["autoscaling_config"] = signal_only_autoscaling(a.min_replicas, pool.initial_replicas(), a.max_replicas,
                                                             a.signal_interval_s)
    return opts


def signal_only_autoscaling(min_replicas: int, initial: int, max_replicas: int, interval_s: float) -> AutoscalingConfig:
    """Serve autoscaling for a deployment the app-level goodput policy decides
    (cluster/autoscaler.py): its replicas push `record_autoscaling_stats()` every
    `interval_s`, and Serve adds no delays of its own (the policy has its windows)."""
    return AutoscalingConfig(
        min_replicas=min_replicas, initial_replicas=initial, max_replicas=max_replicas,
        upscale_delay_s=0.0, downscale_delay_s=0.0,
        metrics_interval_s=interval_s, look_back_period_s=2 * interval_s,
    )


def router_configs(cfg: ClusterConfig) -> dict[str, RequestRouterConfig]:
    """Request routers per pool from `cfg.router` (empty: Serve's default)."""
    r = cfg.router
    if r.policy == "default":
        return {}
    common = {"request_routing_stats_period_s": r.stats_period_s, "request_routing_stats_timeout_s": 10.0}
    config = r.model_dump()
    kwargs = {"config": config, "block_size": cfg.engine.block_size,
              "model_fingerprint": expected_model_fingerprint(cfg.engine)}
    classes = {"prefill": "KVAwarePrefillRouter", "decode": "KVAwareDecodeRouter",
               "aggregated": "KVAwareAggregatedRouter"}
    return {pool: RequestRouterConfig(request_router_class=f"routing.router.serve_routers.{name}",
                                      request_router_kwargs=kwargs, **common)
            for pool, name in classes.items()}


def _pool_args(cfg: ClusterConfig, pool: PoolConfig) -> dict:
    return {"engine": cfg.pool_engine(pool).model_dump(), "threads": pool.threads, "telemetry": _telemetry(cfg)}


def _telemetry(cfg: ClusterConfig) -> dict:
    """`telemetry:` with this process's `OTEL_*` variables applied: every replica
    traces the same way, wherever Ray starts it."""
    return cfg.telemetry.resolved().model_dump()


def build_app(cfg: ClusterConfig):
    """The Serve application: the pool that decodes as the HTTP ingress (the gateway
    inside each of its replicas), the prefill pool beside it in P/D mode, and, behind
    HAProxy with the KV-aware router, the ingress request router. Every replica gets
    its own room's settings, dumped."""
    env = dict(REPLICA_ENV)
    if os.environ.get(KEYS_ENV):  # the ingress replicas may run on other nodes: hand the keys over
        env[KEYS_ENV] = os.environ[KEYS_ENV]
    gateway_args = {"gateway": cfg.gateway.model_dump(), "engine": cfg.engine.model_dump(),
                    "telemetry": _telemetry(cfg), "slo": cfg.slo.model_dump(),
                    "ingress_routed": cfg.routes_at_ingress()}
    routers = router_configs(cfg)
    prefix_index = PrefixIndexConfig.model_validate(cfg.router.model_dump(include=set(PrefixIndexConfig.model_fields)))
    if cfg.mode == "aggregated":
        server = {**_pool_args(cfg, cfg.aggregated), "engine_process": cfg.aggregated.engine_process is not False}
        if routers:  # the routers follow the replicas' KV events
            server["prefix_index"] = prefix_index.model_dump()
        return _with_ingress_router(cfg, _ingress(cfg, env, routers=routers).bind(**gateway_args, server=server), env)
    # A prefill replica's leases outlive its calls; so do a draining decode replica's
    # (the sequences it moved).
    lease_drain_s = cfg.transfer.lease_ttl_s + 5
    prefill_opts = _options("prefill", cfg.prefill, drain_at_least_s=lease_drain_s)
    if routers:
        prefill_opts["request_router_config"] = routers["prefill"]
    prefill = serve.deployment(PrefillServer).options(**prefill_opts).bind(
        **_pool_args(cfg, cfg.prefill),
        transfer=cfg.transfer.model_dump(),
        cache=cfg.cache.model_dump(),
        prefix_index=prefix_index.model_dump(),
        engine_process=cfg.prefill.engine_process,
    )
    # Decode's KV events serve only prompts prefilled on decode (router.disaggregation).
    decode_events = prefix_index.model_dump() if cfg.router.disaggregation.mode != "always" else None
    server = {**_pool_args(cfg, cfg.decode), "transfer": cfg.transfer.model_dump(), "prefix_index": decode_events,
              "engine_process": cfg.decode.engine_process}
    return _with_ingress_router(cfg, _ingress(cfg, env, drain_at_least_s=lease_drain_s, routers=routers).bind(
        **gateway_args, prefill=prefill, server=server, disaggregation=cfg.router.disaggregation.model_dump(),
        transfer_timeout_s=cfg.transfer.timeout_s,
    ), env)


def _with_ingress_router(cfg: ClusterConfig, pool, env: dict):
    """`pool` (the ingress deployment, bound) as the app; behind HAProxy with the KV-aware
    router, with the ingress request router that chooses among its replicas
    (`ClusterConfig.routes_at_ingress`), from the load and KV events they report."""
    if not cfg.routes_at_ingress():
        return pool
    router = serve.deployment(IngressRouter).options(
        name="ingress_router", ray_actor_options={"runtime_env": {"env_vars": env}},
    ).bind(pool=pool, engine=cfg.engine.model_dump(), gateway=cfg.gateway.model_dump())
    # Ray 2.60's private hook (Serve LLM's direct streaming uses the same): HAProxy asks
    # `router` where each POST to `pool` goes.
    return pool._with_ingress_request_router(router)


def _ingress(cfg: ClusterConfig, env: dict, drain_at_least_s: float = 0.0,
             routers: dict[str, RequestRouterConfig] | None = None):
    """The ingress deployment: the pool whose replicas stream the tokens
    (`ClusterConfig.ingress_deployment`: aggregated, or decode in P/D), named after the
    pool and sized and scaled by it, each replica running the gateway and that pool's
    engine. HAProxy (or Serve's proxy) hands each HTTP request to one of them by load,
    unless the ingress request router chooses (`_with_ingress_router`) with the pool's
    router from `routers`. A decode replica's own handle to its deployment (the
    others, for migrations and moves) uses that router too."""
    name = cfg.ingress_deployment()
    pool = cfg.pools()[name]
    opts = _options(name, pool, max(drain_at_least_s, cfg.gateway.drain_timeout_s))
    opts["ray_actor_options"]["num_cpus"] = pool.num_cpus + cfg.gateway.num_cpus
    opts["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    # The gateway's admission answers 429; a decode replica also takes the passes and
    # moved sequences the others hand on.
    opts["max_ongoing_requests"] = cfg.gateway.max_pending_requests * 2 + (pool.max_ongoing_requests
                                                                         if name == "decode" else 0)
    # The pool's router also places the passes its replicas hand each other (it keeps a
    # replica whose engine is lost out of them); behind Serve's proxy it orders an HTTP
    # request's candidates at random.
    if routers:
        opts["request_router_config"] = routers[name]
    return Gateway.options(**opts)
