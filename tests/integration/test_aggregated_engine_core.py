"""The aggregated replica's engine core in its own process, on a real Serve app (the
"aggregated" cluster, and "colocated", whose replicas run the gateway too): it serves,
and a child that dies is a failed health check that Serve answers with a new replica,
never a replica that answers without an engine."""

from __future__ import annotations

import os
import signal

import pytest
from duet_cluster import Duet, complete, prompt, wait_new_replica

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("setup", [
    pytest.param("aggregated", marks=pytest.mark.cluster("aggregated")),
    # The gateway inside the replica: its health check is the engine's too.
    pytest.param("colocated", marks=pytest.mark.cluster("colocated")),
])
def test_a_replica_whose_engine_core_dies_is_replaced(duet: Duet, setup):
    before = duet.stats("aggregated")
    pid = before["engine_pid"]
    assert pid is not None and pid != os.getpid(), "the aggregated pool's default runs its engine in a child"
    body = complete(duet, prompt(24, 9700), max_tokens=4, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 4

    os.kill(pid, signal.SIGKILL)
    after = wait_new_replica(duet, "aggregated", {before["replica_id"]})
    assert after != before["replica_id"]
    assert duet.stats("aggregated")["engine_pid"] not in (None, pid)
    body = complete(duet, prompt(24, 9701), max_tokens=4, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 4
