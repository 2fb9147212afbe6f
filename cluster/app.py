"""Builds the Ray Serve application from a `ClusterConfig`: the pools as
deployments, the gateway as ingress, each sized from its pool config."""

from __future__ import annotations

from ray import serve
from ray.serve.config import AutoscalingConfig

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


def build_app(cfg: ClusterConfig):
    conf = cfg.model_dump()
    gateway = Gateway.options(
        ray_actor_options={"num_cpus": cfg.gateway.num_cpus, "runtime_env": {"env_vars": REPLICA_ENV}},
        max_ongoing_requests=cfg.gateway.max_pending_requests * 2,
    )
    if cfg.mode == "aggregated":
        pool = serve.deployment(AggregatedServer).options(**_options("aggregated", cfg.aggregated))
        return gateway.bind(conf, aggregated=pool.bind(conf))
    prefill = serve.deployment(PrefillServer).options(**_options("prefill", cfg.prefill))
    decode = serve.deployment(DecodeServer).options(**_options("decode", cfg.decode))
    return gateway.bind(conf, prefill=prefill.bind(conf), decode=decode.bind(conf))
