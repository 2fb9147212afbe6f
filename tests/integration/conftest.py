"""Fixtures over the integration harness (duet_cluster.py): one Ray cluster per
session, the duet app deployed on demand, and the private Redis servers of the
configs that use one.

Tests name the cluster config they need with ``@pytest.mark.cluster("name")``
(a key of ``CLUSTERS``) and take the ``duet`` fixture. Collection sorts tests by
that name so each config is deployed once: this machine has 2 cores, and every
redeploy costs model loads.
"""

from __future__ import annotations

import time

import pytest
from cpu_meter import TreeCPU
from duet_cluster import (
    CLUSTERS,
    OTLP_PORT,
    Deployer,
    Duet,
    RedisServer,
    cluster_config,
    redis_ports,
    start_ray,
    stop_ray,
)

from telemetry.otlp_sink import OTLPSink

NO_CONFIG = "none"  # in --configs / --skip-configs: the tests that deploy no cluster config


def pytest_addoption(parser):
    # scripts/test.sh splits the session in two (each part its own Ray cluster) to run
    # one part beside the other stages.
    group = parser.getgroup("duet")
    group.addoption("--configs", default="", help="run only the tests of these cluster configs "
                    f"(comma-separated names from duet_cluster.CLUSTERS; '{NO_CONFIG}': tests without one)")
    group.addoption("--skip-configs", default="", help="leave out the tests of these cluster configs")


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster(name): the duet cluster config a test runs against")


def _cluster_name(item) -> str | None:
    m = item.get_closest_marker("cluster")
    return m.args[0] if m else None


# Where the session's time goes, per cluster config (its tests' setup, call and
# teardown, its deploys included), printed at the end: the suite's budget is spent here.
# Wall seconds, and the CPU seconds of this process and all it started (cpu_meter.py):
# a config's CPU is what it costs when the machine is shared.
_SECONDS: dict[str, float] = {}
_CPU: dict[str, float] = {}
_TESTS: dict[str, int] = {}
_DEPLOYERS: list[Deployer] = []
_METER: list[TreeCPU] = []  # started with the first test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _METER:
        _METER.append(TreeCPU())
    started, cpu = time.monotonic(), _METER[0].seconds()
    yield
    name = _cluster_name(item) or "(none)"
    _SECONDS[name] = _SECONDS.get(name, 0.0) + time.monotonic() - started
    _CPU[name] = _CPU.get(name, 0.0) + _METER[0].seconds() - cpu
    _TESTS[name] = _TESTS.get(name, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS:
        return
    deploys: dict[str, list[float]] = {}
    for deployer in _DEPLOYERS:
        for name, seconds in deployer.deploys:
            deploys.setdefault(name, []).append(seconds)
    terminalreporter.section("seconds per cluster config")
    terminalreporter.line(f"{'config':<14}{'tests':>6}{'total s':>9}{'CPU s':>8}{'deploys s':>14}")
    for name, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1]):
        spent = " + ".join(f"{d:.0f}" for d in deploys.get(name, [])) or "-"
        terminalreporter.line(f"{name:<14}{_TESTS[name]:>6}{seconds:>9.0f}{_CPU[name]:>8.0f}{spent:>14}")
    wall, cpu = sum(_SECONDS.values()), sum(_CPU.values())
    terminalreporter.line(f"{'all':<14}{sum(_TESTS.values()):>6}{wall:>9.0f}{cpu:>8.0f}"
                          f"   ({cpu / wall:.2f} cores on average)")
    terminalreporter.section("CPU seconds per kind of process (the top 12)")
    for kind, seconds, processes in _METER[0].by_kind()[:12]:
        terminalreporter.line(f"{seconds:>8.0f}  {kind} ({processes} processes)")


def _config_names(config, option: str) -> set[str] | None:
    value = config.getoption(option)
    if not value:
        return None
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = names - {*CLUSTERS, NO_CONFIG}
    if unknown:
        raise pytest.UsageError(f"{option}: no cluster config named {', '.join(sorted(unknown))}")
    return names


def pytest_collection_modifyitems(session, config, items):
    only, skip = _config_names(config, "--configs"), _config_names(config, "--skip-configs")
    if only is not None or skip is not None:
        def chosen(it) -> bool:
            name = _cluster_name(it) or NO_CONFIG
            return (only is None or name in only) and (skip is None or name not in skip)

        config.hook.pytest_deselected(items=[it for it in items if not chosen(it)])
        items[:] = [it for it in items if chosen(it)]
    order = {name: i for i, name in enumerate(CLUSTERS)}
    # Stable: tests without a cluster first, then grouped by config, file order kept.
    items.sort(key=lambda it: -1 if _cluster_name(it) is None else order[_cluster_name(it)])


@pytest.fixture(scope="session")
def ray_cluster():
    start_ray()
    try:
        yield
    finally:
        stop_ray()


@pytest.fixture(scope="session")
def deployer(ray_cluster) -> Deployer:
    deployer = Deployer()
    _DEPLOYERS.append(deployer)
    return deployer


@pytest.fixture(scope="session")
def redis_servers(tmp_path_factory):
    """A private Redis per port, started (and emptied) the first time a test needs it,
    stopped when the session ends."""
    servers: dict[int, RedisServer] = {}

    def get(port: int) -> RedisServer:
        if port not in servers:
            redis = RedisServer(port, tmp_path_factory.mktemp(f"redis-{port}"))
            if redis.run("start").returncode != 0:
                pytest.skip("Redis could not be started with scripts/redis.sh")
            redis.flush()
            servers[port] = redis
        return servers[port]

    yield get
    for redis in servers.values():
        redis.run("stop")


@pytest.fixture
def cluster_redis(request, redis_servers) -> RedisServer | None:
    """The private Redis of this test's cluster config (None if it uses none), running:
    a test that stopped it and failed does not leave it down for the next one."""
    ports = redis_ports(cluster_config(_cluster_name(request.node) or "nixl"))
    assert len(ports) <= 1, f"a config with several Redis servers: {ports}"
    if not ports:
        return None
    redis = redis_servers(ports[0])
    done = redis.run("start")
    assert done.returncode == 0, done.stderr
    return redis


@pytest.fixture(scope="session")
def otlp_sink():
    """The span sink a traced config exports to, listening from before its cluster's
    first span to the session's end: an exporter that finds nobody listening backs
    off, and would hold later spans back."""
    sink = OTLPSink(OTLP_PORT)
    yield sink
    sink.close()


@pytest.fixture
def duet(request, deployer, cluster_redis) -> Duet:
    """The duet app for this test's ``cluster`` marker (default: nixl, disaggregated),
    deployed after its Redis (and, if it traces, its span sink) is up."""
    name = _cluster_name(request.node) or "nixl"
    if cluster_config(name).telemetry.tracing:
        request.getfixturevalue("otlp_sink")
    return deployer(name)
