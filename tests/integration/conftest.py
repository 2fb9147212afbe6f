"""One local Ray cluster per session and a duet app deployed on demand.

Tests name the cluster config they need with ``@pytest.mark.cluster("name")``
(a key of ``CLUSTERS``) and take the ``duet`` fixture. Collection sorts tests by
that name so each config is deployed once: its generated Serve config
(cluster/serve_config.py) replaces the app only when the config changes. This machine has 2 cores; every redeploy costs two model loads.
"""

from __future__ import annotations

import logging

import pytest
from duet_cluster import CHAOS_REDIS_PORT, CLUSTERS, METRICS_PORT, PORT, Duet, cluster_config, wait_for


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster(name): the duet cluster config a test runs against")


def _cluster_name(item) -> str | None:
    m = item.get_closest_marker("cluster")
    return m.args[0] if m else None


def pytest_collection_modifyitems(session, config, items):
    order = {name: i for i, name in enumerate(CLUSTERS)}
    # Stable: tests without a cluster first, then grouped by config, file order kept.
    items.sort(key=lambda it: -1 if _cluster_name(it) is None else order[_cluster_name(it)])


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    from cluster.app import REPLICA_ENV

    ray.init(
        address="local",  # a cluster of its own, whatever `ray start` last recorded
        num_cpus=4,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": REPLICA_ENV},
        # Replicas' metrics reach this node's agent every second (default 10 s).
        _metrics_export_port=METRICS_PORT,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    try:
        yield ray
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class _Deployer:
    def __init__(self):
        self.current: Duet | None = None

    def __call__(self, name: str) -> Duet:
        cfg = cluster_config(name)
        if self.current is not None and self.current.cfg == cfg:
            return self.current
        from cluster.serve_cli import wait_ready
        from cluster.serve_config import deploy

        self.current = None
        deploy(cfg, timeout_s=300)  # the generated Serve config, as `duet serve` deploys it
        url = f"http://127.0.0.1:{PORT}"
        wait_ready(url, timeout=240)
        self.current = Duet(name, cfg, url)
        self.wait_settled(self.current)
        return self.current

    @staticmethod
    def wait_settled(d: Duet) -> None:
        """After a redeploy the old replicas may still answer; wait for the new config's."""
        expect = d.cfg.decode.num_kv_blocks if d.cfg.mode == "disaggregated" else None
        pool = "decode" if d.cfg.mode == "disaggregated" else "aggregated"
        total = expect or d.cfg.engine.num_kv_blocks
        wait_for(lambda: d.stats(pool)["kv_blocks_total"] == total, 60, what=f"{pool} with {total} blocks")


@pytest.fixture(scope="session")
def deployer(ray_cluster) -> _Deployer:
    return _Deployer()


@pytest.fixture(scope="session")
def chaos_redis(tmp_path_factory):
    """The "chaos" cluster's private Redis (its prefix index and KV tier); the soak
    restarts it."""
    from conftest_kv import RedisServer

    redis = RedisServer(CHAOS_REDIS_PORT, tmp_path_factory.mktemp("chaos-redis"))
    if redis.run("start").returncode != 0:
        pytest.skip("Redis could not be started with scripts/redis.sh")
    redis.flush()
    yield redis
    redis.run("stop")


@pytest.fixture
def duet(request, deployer) -> Duet:
    """The duet app for this test's ``cluster`` marker (default: nixl, disaggregated)."""
    name = _cluster_name(request.node) or "nixl"
    if name == "chaos":
        request.getfixturevalue("chaos_redis")  # up before the app that uses it
    return deployer(name)
