"""`DrainState`: when a replica counts as draining, from the running sets Serve's
controller shows it (kvtransfer/drain.py)."""

import pytest

from kvtransfer.drain import DrainState, DrainWatch

pytestmark = pytest.mark.unit


def test_a_replica_drains_when_it_leaves_the_running_set_others_remain_in():
    s = DrainState("a")
    assert not s.update(["b"])  # not started yet: it was never running
    assert not s.update(["a", "b"]) and not s.draining
    assert s.update(["b"]) and s.draining and s.others == ("b",)
    assert not s.update(["b", "c"])  # once


def test_a_deployment_going_away_is_no_drain_to_move_from():
    s = DrainState("a")
    s.update(["a", "b"])
    assert not s.update([]) and not s.draining


def test_outside_a_serve_replica_the_watch_does_not_start():
    assert not DrainWatch(lambda: None).start()
