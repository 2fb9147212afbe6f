"""`duet serve` behind HAProxy waits until HAProxy forwards to every running ingress
replica (cluster/serve_cli.py): the count it reads from HAProxy's stats page."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from cluster.serve_cli import servers_up

pytestmark = pytest.mark.unit

# HAProxy's stats as CSV (columns 1, 2 and 18 of a real page; the rest left empty), a
# second after a 2-replica aggregated deploy: one replica's checks not settled.
STATS = "\n".join(",".join([px, sv, *[""] * 15, status]) for px, sv, status in [
    ("# pxname", "svname", "status"),
    ("http_frontend", "FRONTEND", "OPEN"),
    ("http-duet", "SERVE_REPLICA_duet-aggregated-poueupea", "UP"),
    ("http-duet", "SERVE_REPLICA_duet-aggregated-02u9lkmi", "UP 1/2"),
    ("http-duet", "SERVE_REPLICA_duet-aggregated-zzzzzzzz", "DOWN"),
    ("http-duet", "SERVE_PROXY_ACTOR-fallback-382642e2", "UP"),
    ("http-duet", "BACKEND", "UP"),
    ("http-duet-via-ingress-request-router", "SERVE_REPLICA_duet-aggregated-poueupea", "UP"),
])


def test_the_replicas_haproxy_forwards_to_are_counted_once_each_and_only_when_up():
    assert servers_up(STATS, "duet", "aggregated") == 2
    assert servers_up(STATS, "duet", "decode") == 0
    assert servers_up("", "duet", "aggregated") == 0


def test_the_ingress_deployment_is_the_pool_that_decodes():
    assert load_config(overrides={"mode": "aggregated"}).ingress_deployment() == "aggregated"
    assert load_config().ingress_deployment() == "decode"
