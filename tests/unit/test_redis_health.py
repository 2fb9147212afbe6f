"""When the Redis tier counts as down (prefill/kv_tier/health.py), with a scripted probe."""

from __future__ import annotations

import pytest
import redis

from prefill.kv_tier.health import RedisHealth
from prefill.kv_tier.stats import TierStats

pytestmark = pytest.mark.unit


class ScriptedProbe:
    """Answers each ping with the next outcome: None (pong) or an exception to raise."""

    def __init__(self, *outcomes: Exception | None):
        self.outcomes = list(outcomes)
        self.pings = 0

    def ping(self) -> bool:
        self.pings += 1
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return True

    def close(self) -> None:
        pass


def health(probe: ScriptedProbe, now: list[float]) -> tuple[RedisHealth, TierStats, list[bool]]:
    stats, told = TierStats(), []
    h = RedisHealth("redis://unused", 0.2, check_interval_s=0.5, retry_interval_s=5.0, stats=stats,
                    on_probe=told.append, clock=lambda: now[0], probe=probe)
    return h, stats, told


def test_one_slow_answer_is_asked_again_at_once_and_does_not_mark_redis_down():
    probe = ScriptedProbe(redis.exceptions.TimeoutError("Timeout reading from socket"), None)
    h, stats, told = health(probe, [0.0])
    assert h.check() is True and h.up
    assert probe.pings == 2 and stats.errors == 0 and stats.skipped == 0 and told == [True]


def test_two_timeouts_in_a_row_mark_it_down_until_the_retry_interval():
    now = [0.0]
    probe = ScriptedProbe(redis.exceptions.TimeoutError(), redis.exceptions.TimeoutError(), None)
    h, stats, told = health(probe, now)
    assert h.check() is False and probe.pings == 2 and stats.errors == 1 and told == [False]
    now[0] = 4.9
    assert h.check() is False and probe.pings == 2 and stats.skipped == 2  # not probed before 5 s
    now[0] = 5.0
    assert h.check() is True and h.up and told == [False, True]


def test_a_refused_connection_is_down_at_once():
    probe = ScriptedProbe(redis.exceptions.ConnectionError("Connection refused"))
    h, stats, _ = health(probe, [0.0])
    assert h.check() is False and probe.pings == 1 and stats.errors == 1
