"""`duet serve --decode-replicas 2` in P/D mode, every
prompt prefilled where it decodes (`router.disaggregation.mode: never`): each decode
replica runs the gateway and is an HTTP ingress, and HAProxy asks the ingress request
router which one takes a request; the decode router's choice puts a prompt on the
replica whose KV events show its prefix. Its own `duet serve` and Ray, after the
HAProxy aggregated one (this file sorts after it; both stop their server).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from routing_checks import assert_prefix_routing
from serve_process import CONFIG, Served, running

pytestmark = [pytest.mark.e2e, pytest.mark.stops_server]


@pytest.fixture(scope="module")
def direct_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with running(tmp_path_factory.mktemp("haproxy-pd"),
                 args=("--mode", "disaggregated", "--decode-replicas", "2"),
                 config=CONFIG + "router: {disaggregation: {mode: never}}\n") as s:
        yield s


def test_the_ingress_request_router_sends_each_prompt_to_the_decode_replica_holding_its_prefix(direct_pd: Served):
    assert_prefix_routing(direct_pd, "decode")
