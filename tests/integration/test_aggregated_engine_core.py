"""The aggregated replica's engine core in its own process, on a real Serve app (the
"aggregated" cluster, whose replicas run the gateway too): it serves, and a child
that dies is replaced in place (engine/core_restarts.py): the same replica starts a
new engine core, a request sent the moment the old one died waits for it instead of
failing, and Serve never replaces the replica."""

from __future__ import annotations

import os
import signal

import pytest
from duet_cluster import Duet, complete, engine_restarts, live_replicas, prompt, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.cluster("aggregated")
def test_a_replica_whose_engine_core_dies_starts_a_new_one_in_place(duet: Duet):
    before = duet.stats("aggregated")
    pid = before["engine_pid"]
    assert pid is not None and pid != os.getpid(), "the aggregated pool's default runs its engine in a child"
    body = complete(duet, prompt(24, 9700), max_tokens=4, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 4
    replicas = live_replicas("aggregated")
    restarts_before = {r: engine_restarts(r)["engine_restarts"] for r in replicas}

    os.kill(pid, signal.SIGKILL)
    # At once: the request waits for the new engine core (a single replica: nowhere else to go).
    body = complete(duet, prompt(24, 9701), max_tokens=4, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 4
    victim = before["replica_id"]
    restarted = wait_for(lambda: (s := engine_restarts(victim))["engine_restarts"] > restarts_before[victim] and s,
                         120, what="the engine core restarted in place")
    assert restarted["engine_serving"] == 1 and restarted["engine_restart_failures"] == 0
    assert live_replicas("aggregated") == replicas  # the same replicas: none replaced
    assert wait_for(lambda: (s := duet.stats("aggregated"))["replica_id"] == victim and s, 60,
                    what="the restarted replica's stats")["engine_pid"] not in (None, pid)
