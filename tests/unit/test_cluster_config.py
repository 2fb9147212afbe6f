"""The cluster config composes each room's settings: one name, one default and one
validator per setting, errors that name the field, and the checks across rooms."""

from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, load_config
from engine.config import ConfigError, EngineConfig
from kvtransfer.config import TransferConfig
from prefill.kv_tier.config import KVTierConfig
from routing.openai.config import GatewayConfig
from routing.router.policy import RouterConfig

pytestmark = pytest.mark.unit


def test_sections_are_the_rooms_own_models():
    cfg = ClusterConfig()
    assert type(cfg.engine) is EngineConfig
    assert type(cfg.transfer) is TransferConfig
    assert type(cfg.router) is RouterConfig
    assert type(cfg.cache) is KVTierConfig
    assert type(cfg.gateway) is GatewayConfig


def test_defaults_are_the_rooms_defaults():
    cfg = ClusterConfig()
    assert cfg.router == RouterConfig()
    assert cfg.cache == KVTierConfig() and not cfg.cache.enabled
    assert cfg.transfer.lease_ttl_s == 30.0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prefill.num_cpus": 0}, "prefill.num_cpus"),
        ({"engine.block_size": 0}, "engine.block_size"),
        ({"router.overlap_weight": -1}, "router.overlap_weight"),
        ({"router.redis_url": "http://x"}, "router.redis_url"),
        ({"cache.disk_path": "/tmp/x"}, "cache"),
        ({"transfer.backend": "carrier-pigeon"}, "transfer.backend"),
        ({"gateway.port": 70000}, "gateway.port"),
        ({"telemetry.sample_ratio": 2}, "telemetry.sample_ratio"),
        ({"telemetry.exporter": "zipkin"}, "telemetry.exporter"),
        ({"slo.ttft_ms": 0}, "slo.ttft_ms"),
        ({"slo.p99_ms": 1}, "slo.p99_ms"),
        ({"budget.cpus": -1}, "budget.cpus"),
        ({"prefill.autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "prefill.autoscaling"),
        ({"prefill.autoscaling": {"policy": "vibes"}}, "prefill.autoscaling.policy"),
        ({"decode.autoscaling": {"max_step": 0}}, "decode.autoscaling.max_step"),
        ({"decode.autoscaling": {"profile": "/nonexistent.json"}}, "decode.autoscaling"),
        ({"mode": "aggregated", "aggregated.autoscaling": {"policy": "goodput"}}, "config"),
    ],
)
def test_an_invalid_value_names_its_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.field == field


def test_chunk_size_must_hold_whole_blocks():
    with pytest.raises(ConfigError, match="multiple of block_size"):
        load_config(None, {"cache.chunk_size": 24, "engine.block_size": 16})
    assert load_config(None, {"cache.chunk_size": 32, "engine.block_size": 16}).cache.chunk_size == 32


def test_a_pool_may_size_its_own_kv_pool():
    cfg = load_config(None, {"engine.num_kv_blocks": 100, "decode.num_kv_blocks": 40})
    assert cfg.pool_engine(cfg.decode).num_kv_blocks == 40
    assert cfg.pool_engine(cfg.prefill).num_kv_blocks == 100


def test_the_shipped_config_files_load():
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml")):
        load_config(path)


def test_a_profile_path_in_a_config_file_is_relative_to_the_file(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "p.json").write_text('{"prefill_model": {"b_ms_per_token": 2.0}}')
    (tmp_path / "c.yaml").write_text("prefill:\n  autoscaling: {policy: goodput, profile: profiles/p.json}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.prefill.autoscaling.load_profile().prefill_model.b_ms_per_token == 2.0


def test_autoscaled_pools_start_within_their_bounds_and_reserve_their_maximum():
    cfg = load_config(None, {"prefill.replicas": 5, "prefill.num_cpus": 1, "decode.num_cpus": 1, "gateway.num_cpus": 1,
                             "prefill.autoscaling": {"policy": "goodput", "min_replicas": 1, "max_replicas": 3},
                             "decode.autoscaling": {"policy": "fixed", "max_replicas": 4}})
    assert cfg.prefill.initial_replicas() == 3 and cfg.decode.initial_replicas() == 1
    assert cfg.required_cpus() == 1 + 3 + 1
    assert cfg.required_cpus(at_most=True) == 1 + 3 + 1  # a fixed pool stays at `replicas`
    assert set(cfg.scaled_pools("goodput")) == {"prefill"}


@pytest.mark.parametrize("pool", ["aggregated", "prefill", "decode"])
def test_every_pool_may_run_its_engine_in_a_child(pool):
    assert getattr(load_config(overrides={f"{pool}.engine_process": True}), pool).engine_process
    assert getattr(load_config(), pool).engine_process is None  # the pool's default: on (prefill, decode: on a CPU)


def test_a_prefill_engine_with_an_lmcache_tier_may_run_in_a_child():
    cfg = load_config(overrides={"prefill.engine_process": True, "cache.cpu_bytes": 1 << 20})
    assert cfg.cache.enabled and cfg.prefill.engine_process  # the tier is built in the child


def test_the_ingress_replicas_are_chosen_by_the_kv_aware_router_only_behind_haproxy():
    assert load_config().gateway.ingress == "haproxy"  # the default
    # P/D: the gateway runs in each decode replica, with the goodput policy scaling the pools.
    load_config(overrides={"decode.replicas": 2, "decode.autoscaling": {"policy": "goodput"}})
    # Serve's Python proxy picks the replica by load alone: the KV-aware router cannot.
    with pytest.raises(ConfigError, match="only behind gateway.ingress: haproxy"):
        load_config(overrides={"mode": "aggregated", "aggregated.replicas": 2, "gateway.ingress": "proxy"})
    with pytest.raises(ConfigError, match="only behind gateway.ingress: haproxy"):
        load_config(overrides={"mode": "aggregated", "gateway.ingress": "proxy",
                               "aggregated.autoscaling": {"policy": "queue", "max_replicas": 3}})
    # HAProxy asks the ingress request router, which makes the KV-aware choice.
    assert load_config(overrides={"mode": "aggregated", "aggregated.replicas": 2}).routes_at_ingress()
    # Whatever its size (a Serve config sizes the pool apart), unless the policy is default.
    assert load_config(overrides={"mode": "aggregated"}).routes_at_ingress()
    assert not load_config(overrides={"mode": "aggregated", "router.policy": "default"}).routes_at_ingress()
    assert load_config().routes_at_ingress()  # P/D
    assert not load_config(overrides={"gateway.ingress": "proxy"}).routes_at_ingress()
    # The setting that chose between a gateway of its own and this one is gone.
    with pytest.raises(ConfigError, match="gateway.colocate"):
        load_config(overrides={"gateway.colocate": True})
    two = load_config(overrides={"mode": "aggregated", "aggregated.replicas": 2, "gateway.ingress": "proxy",
                                 "router.policy": "default"})
    assert two.aggregated.replicas == 2
