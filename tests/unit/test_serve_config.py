"""The generated Serve config (cluster/serve_config.py) and the app-level policy
that Serve's controller runs from it (cluster/autoscaler.py), with fake contexts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from autoscaling import signals as sig
from cluster.autoscaler import GoodputAutoscaler
from cluster.config import ClusterConfig, load_config
from cluster.serve_config import IMPORT_PATH, POLICY_PATH, cluster_config_of, serve_config

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_every_shipped_config_generates_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    for path in sorted(DEPLOY.glob("*.yaml")):
        config = serve_config(load_config(path))
        ServeDeploySchema.model_validate(config)
        app = config["applications"][0]
        assert app["import_path"] == IMPORT_PATH
        assert ClusterConfig.model_validate(app["args"]["config"]).pools().keys() == load_config(path).pools().keys()


def test_the_goodput_policy_travels_with_its_profile_numbers_not_the_file():
    cfg = load_config(DEPLOY / "autoscaling.yaml")
    app = serve_config(cfg)["applications"][0]
    policy = app["autoscaling_policy"]
    assert policy["policy_function"] == POLICY_PATH
    carried = policy["policy_kwargs"]["config"]
    assert carried == app["args"]["config"]  # the controller and the build task read the same config
    profile = carried["prefill"]["autoscaling"]["profile"]
    assert profile == cfg.prefill.autoscaling.load_profile().model_dump(mode="json", exclude_defaults=True)
    assert profile["prefill_model"]["b_ms_per_token"] > 0  # the numbers, not the file
    assert ClusterConfig.model_validate(carried).slo == cfg.slo


def test_without_a_goodput_pool_serve_decides_alone():
    cfg = load_config(None, {"prefill.autoscaling": {"policy": "queue", "max_replicas": 2}})
    assert "autoscaling_policy" not in serve_config(cfg)["applications"][0]


def test_resizing_a_fixed_pool_keeps_the_app_code_version():
    """Serve restarts every replica when an app's code version changes (import path,
    args, policies); a fixed pool's size travels apart so resizing only resizes."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    def app(overrides: dict) -> dict:
        return serve_config(load_config(None, overrides))["applications"][0]

    small, big = app({"decode.replicas": 1}), app({"decode.replicas": 3, "prefill.replicas": 2})
    assert big["deployments"] == [{"name": "prefill", "num_replicas": 2}, {"name": "decode", "num_replicas": 3}]
    version = [get_app_code_version(ServeApplicationSchema.model_validate(a)) for a in (small, big)]
    assert version[0] == version[1]
    other = app({"decode.replicas": 3, "engine.max_num_seqs": 8})  # an engine change does restart
    assert get_app_code_version(ServeApplicationSchema.model_validate(other)) != version[0]


def test_a_generated_config_reads_back_as_the_cluster_config():
    cfg = load_config(None, {"prefill.replicas": 2, "decode.replicas": 3,
                             "decode.autoscaling": {"policy": "queue", "max_replicas": 4}})
    assert cluster_config_of(serve_config(cfg)) == cfg
    scaled = serve_config(cfg)["applications"][0]
    assert scaled["deployments"] == [{"name": "prefill", "num_replicas": 2}]  # decode: Serve's autoscaler


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


def _ctx(name: str, target: int, replicas: dict[str, dict[str, float]]):
    rids = [FakeReplicaID(r) for r in replicas]
    metrics: dict = {}
    for rid in rids:
        for k, v in replicas[rid.unique_id].items():
            metrics.setdefault(k, {})[rid] = v
    return SimpleNamespace(deployment_name=name, target_num_replicas=target, running_replicas=rids,
                           aggregated_metrics=metrics)


def test_the_serve_policy_reads_every_deployment_and_decides_the_goodput_pools():
    cfg = load_config(None, {
        "slo": {"ttft_ms": 1000, "tpot_ms": 100},
        "prefill.autoscaling": {"policy": "goodput", "max_replicas": 4, "max_step": 4, "upscale_delay_s": 0,
                                "warmup_s": 0, "profile": str(DEPLOY / "profiles" / "smollm2-135m-cpu.json")},
        "decode.autoscaling": {"policy": "goodput", "max_replicas": 2, "warmup_s": 0},
    })
    kwargs = serve_config(cfg)["applications"][0]["autoscaling_policy"]["policy_kwargs"]
    policy = GoodputAutoscaler(**kwargs)  # the controller's view: no engine, no profile file
    # Each decode replica is an ingress too: it reports its own pool's signals and the
    # end-to-end ones of the requests it took, and the policy adds the arrivals up.
    ingress = {sig.ARRIVAL_PROMPT_TOKENS_PER_S: 300.0, sig.ARRIVALS_PER_S: 0.5, sig.FINISHED: 0.0}
    decode = {sig.RUNNING: 2.0, sig.KV_BLOCKS_USED: 10.0, sig.KV_BLOCKS_TOTAL: 100.0}
    contexts = {
        "p-id": _ctx("prefill", 1, {"p1": {sig.QUEUED_PROMPT_TOKENS: 0.0, sig.WAITING: 0.0}}),
        "d-id": _ctx("decode", 2, {"d1": {**decode, **ingress}, "d2": {**decode, **ingress}}),
    }
    decisions, state = policy(contexts)
    # 600 prompt tokens/s against ~282 per replica at 80%: three prefill replicas; decode stays.
    assert decisions == {"p-id": 3, "d-id": 2}
    assert state == {}


def test_the_gateway_waits_for_a_decode_start_as_long_as_a_pull_may_take():
    from cluster.app import build_app

    app = build_app(load_config(None, {"transfer.timeout_s": 30.0, "router.policy": "default"}))
    assert app._bound_deployment.init_kwargs["transfer_timeout_s"] == 30.0  # Gateway's resilience reads it


def test_the_gateway_is_the_aggregated_pool_itself():
    """One deployment, named and sized after the pool, whose replicas reserve the
    pool's CPU and the gateway's, and build an engine of the pool's config."""
    from cluster.app import build_app

    cfg = load_config(None, {"mode": "aggregated", "aggregated.replicas": 2,
                             "router.policy": "default", "aggregated.threads": 2})
    assert serve_config(cfg)["applications"][0]["deployments"] == [{"name": "aggregated", "num_replicas": 2}]
    deployment = build_app(cfg)._bound_deployment
    assert deployment.name == "aggregated"
    assert deployment.ray_actor_options["num_cpus"] == cfg.aggregated.num_cpus + cfg.gateway.num_cpus
    server = deployment.init_kwargs["server"]
    assert server["threads"] == 2 and server["engine_process"] is True
    assert server["engine"] == cfg.pool_engine(cfg.aggregated).model_dump()
    assert "aggregated" not in deployment.init_kwargs  # no handle to another deployment


def test_several_aggregated_replicas_behind_haproxy_are_chosen_by_the_ingress_request_router():
    """The KV-aware choice among ingress replicas: the pool runs the aggregated
    router and publishes its KV events; an ingress request router, bound to the pool,
    renders prompts with the gateway's own settings."""
    from cluster.app import build_app

    cfg = load_config(None, {"mode": "aggregated", "aggregated.replicas": 2})
    app = build_app(cfg)
    pool = app._bound_deployment
    assert pool.name == "aggregated"
    router_config = pool._deployment_config.request_router_config
    assert router_config.request_router_class.endswith("KVAwareAggregatedRouter")
    assert pool.init_kwargs["server"]["prefix_index"]["prefix_index"] == cfg.router.prefix_index
    router = app._ingress_request_router._bound_deployment
    assert router.name == "ingress_router"
    assert router.init_kwargs["pool"] is app
    assert router.init_kwargs["gateway"] == cfg.gateway.model_dump()
    assert router.init_kwargs["engine"] == cfg.engine.model_dump()
    assert pool.init_kwargs["ingress_routed"] is True  # the route header is HAProxy's: the span reads it
    # What Serve's build task gets: the size travels apart, the router still does.
    assert build_app(cluster_config_of(serve_config(cfg)))._ingress_request_router is not None
    # With Serve's default policy: no router, and HAProxy balances by load.
    balanced = build_app(load_config(None, {"mode": "aggregated", "router.policy": "default"}))
    assert getattr(balanced, "_ingress_request_router", None) is None
    assert "prefix_index" not in balanced._bound_deployment.init_kwargs["server"]
    # No router to set the route header: a client's copy of it would pass HAProxy.
    assert balanced._bound_deployment.init_kwargs["ingress_routed"] is False


def test_the_gateway_in_pd_mode_is_the_decode_pool_itself():
    """Two deployments: prefill, and decode whose replicas run the gateway too (with
    a handle to prefill, none to another decode deployment), reserve the pool's CPU
    and the gateway's, and drain as long as a decode replica's leases last."""
    from cluster.app import build_app

    cfg = load_config(None, {"decode.replicas": 2, "transfer.lease_ttl_s": 7.0, "gateway.ingress": "proxy"})
    names = [d["name"] for d in serve_config(cfg)["applications"][0]["deployments"]]
    assert sorted(names) == ["decode", "prefill"]
    deployment = build_app(cfg)._bound_deployment
    assert deployment.name == "decode"
    assert deployment.ray_actor_options["num_cpus"] == cfg.decode.num_cpus + cfg.gateway.num_cpus
    assert deployment._deployment_config.graceful_shutdown_timeout_s >= 7.0 + 5
    kwargs = deployment.init_kwargs
    assert kwargs["server"]["engine"] == cfg.pool_engine(cfg.decode).model_dump()
    assert kwargs["server"]["transfer"] == cfg.transfer.model_dump()
    assert "decode" not in kwargs and kwargs["prefill"] is not None
    # Behind HAProxy the ingress request router chooses the decode replica, by the decode router.
    routed = build_app(load_config(None, {"decode.replicas": 2}))
    assert routed._bound_deployment.name == "decode"
    assert routed._bound_deployment._deployment_config.request_router_config.request_router_class.endswith(
        "KVAwareDecodeRouter")
    assert routed._ingress_request_router._bound_deployment.init_kwargs["pool"] is routed
    assert routed._bound_deployment.init_kwargs["ingress_routed"] is True
    assert kwargs["ingress_routed"] is False
