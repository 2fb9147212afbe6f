"""Builds the Ray Serve application from a `ClusterConfig`: the pools as
deployments, the gateway as ingress, each sized from its pool config."""

from __future__ import annotations

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from cluster.aggregated import AggregatedServer
from cluster.config import ClusterConfig, PoolConfig
from decode.server import DecodeServer
from prefill.server import PrefillServer
from routing.gateway import Gateway

# Every replica computes block hashes and LMCache keys the same way.
REPLICA_ENV = {"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _options(name: str, pool: PoolConfig) -> dict:
    opts: dict = {
        "name": name,
        "ray_actor_options": {"num_cpus": pool.num_cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
        "max_ongoing_requests": pool.max_ongoing_requests,
        "health_check_period_s": 2,
        "health_check_timeout_s": 10,
        "graceful_shutdown_timeout_s": 5,
    }
    if pool.autoscaling is None:
        opts["num_replicas"] = pool.replicas
    else:
        a = pool.autoscaling
        opts["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas,
            initial_replicas=max(a.min_replicas, min(pool.replicas, a.max_replicas)),
            max_replicas=a.max_replicas,
            target_ongoing_requests=a.target_ongoing_requests,
            upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s,
        )
    return opts


def model_fingerprint(cfg: ClusterConfig) -> str:
    """What `Engine.model_fingerprint` will be on the replicas (routers hash prompts
    with it; replicas also report theirs, which wins on a mismatch)."""
    from engine.config import resolve_device, resolve_dtype
    from engine.weights import resolve_checkpoint

    dtype = resolve_dtype(cfg.engine.dtype, resolve_device(cfg.engine.device))
    return f"{resolve_checkpoint(cfg.engine.model).model_id}|{str(dtype).removeprefix('torch.')}"


def router_configs(cfg: ClusterConfig) -> dict[str, RequestRouterConfig]:
    """Request routers per pool from `cfg.router` (empty: Serve's default)."""
    r = cfg.router
    if r.policy == "default":
        return {}
    common = {"request_routing_stats_period_s": r.stats_period_s, "request_routing_stats_timeout_s": 10.0}
    prefill = RequestRouterConfig(
        request_router_class="routing.request_router.KVAwarePrefillRouter",
        request_router_kwargs={
            "block_size": cfg.engine.block_size,
            "model_fingerprint": model_fingerprint(cfg),
            "overlap_weight": r.overlap_weight,
            "running_weight": r.running_weight,
            "temperature": r.temperature,
            "imbalance_threshold": r.imbalance_threshold,
            "session_affinity_bonus": r.session_affinity_bonus,
            "prefix_index": r.prefix_index,
            "redis_url": r.redis_url,
            "index_key_prefix": r.index_key_prefix,
        },
        **common,
    )
    decode = RequestRouterConfig(
        request_router_class="routing.request_router.KVAwareDecodeRouter",
        request_router_kwargs={
            "block_size": cfg.engine.block_size,
            "decode_kv_weight": r.decode_kv_weight,
            "temperature": r.temperature,
        },
        **common,
    )
    return {"prefill": prefill, "decode": decode}


def build_app(cfg: ClusterConfig):
    conf = cfg.model_dump()
    gateway = Gateway.options(
        ray_actor_options={"num_cpus": cfg.gateway.num_cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
        max_ongoing_requests=cfg.gateway.max_pending_requests * 2,
    )
    if cfg.mode == "aggregated":
        pool = serve.deployment(AggregatedServer).options(**_options("aggregated", cfg.aggregated))
        return gateway.bind(conf, aggregated=pool.bind(conf))
    routers = router_configs(cfg)
    prefill_opts = _options("prefill", cfg.prefill)
    decode_opts = _options("decode", cfg.decode)
    if routers:
        prefill_opts["request_router_config"] = routers["prefill"]
        decode_opts["request_router_config"] = routers["decode"]
    prefill = serve.deployment(PrefillServer).options(**prefill_opts)
    decode = serve.deployment(DecodeServer).options(**decode_opts)
    return gateway.bind(conf, prefill=prefill.bind(conf), decode=decode.bind(conf))
