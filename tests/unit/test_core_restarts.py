"""`CoreRestarts` (engine/core_restarts.py): one restart per loss, a loss during a
restart repaired too, backoff after a failed start, and the health check failing only
once `max_failures` starts in a row have failed. The restart is a fake: this is the
policy, the real child is restarted in tests/integration/test_engine_core_restart.py."""

from __future__ import annotations

import threading
import time

import pytest

from engine.core_restarts import CoreRestarts
from engine.request import EngineDead

pytestmark = pytest.mark.unit


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not before the deadline"
        time.sleep(0.005)


def test_a_loss_is_repaired_once_and_the_replica_serves_again():
    started = threading.Event()
    go = threading.Event()
    calls = []

    def restart() -> None:
        calls.append(1)
        started.set()
        go.wait(10)

    r = CoreRestarts(restart, "test")
    assert r.serving
    r.lost(RuntimeError("gone"))
    assert started.wait(10)
    r.lost(RuntimeError("gone"))  # the same loss reported twice while repairing: once more, not twice
    assert not r.serving
    r.check_health()  # under way: not a failure
    go.set()
    _until(lambda: r.serving)
    assert r.stats()["engine_restarts"] == len(calls) == 2
    assert r.stats()["engine_serving"] == 1 and r.last_down_s > 0


def test_failed_starts_back_off_and_then_fail_the_health_check():
    attempts: list[float] = []

    def restart() -> None:
        attempts.append(time.monotonic())
        raise RuntimeError("no memory")

    r = CoreRestarts(restart, "test", max_failures=3, backoff_s=0.01, max_backoff_s=0.02)
    r.lost(RuntimeError("gone"))
    _until(lambda: len(attempts) == 3 and r._thread is None)
    time.sleep(0.05)
    assert len(attempts) == 3  # it gave up
    assert not r.serving
    with pytest.raises(EngineDead, match="3 engine core starts failed in a row: no memory"):
        r.check_health()
    assert r.stats()["engine_restart_failures"] == 3 and r.stats()["engine_restarts"] == 0


def test_a_start_that_fails_once_is_tried_again():
    results = iter([RuntimeError("busy"), None])

    def restart() -> None:
        if (e := next(results)) is not None:
            raise e

    r = CoreRestarts(restart, "test", backoff_s=0.01)
    r.lost(RuntimeError("gone"))
    _until(lambda: r.serving)
    r.check_health()
    assert r.stats()["engine_restarts"] == 1 and r.stats()["engine_restart_failures"] == 1


def test_nothing_restarts_after_close():
    calls = []
    r = CoreRestarts(lambda: calls.append(1), "test")
    r.close()
    r.lost(RuntimeError("gone"))
    time.sleep(0.05)
    assert calls == [] and r.serving
