"""Whether the Redis tier answers: a fail-fast probe, re-checked on an interval.

Redis is optional at runtime. While it does not answer, the tier bypasses its
LMCache backend (CPU and disk keep working) and probes again every
`redis_retry_interval_s`, so an outage costs one short timeout per interval rather
than one per request.

A ping that times out is sent once more at once, and only a second timeout marks
Redis down: on a few busy cores one slow answer is a scheduling blip, not an
outage, and a tier marked down would skip every store until the next probe (lost
entries that show up later as misses). A refused connection is an outage at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from prefill.kv_tier.stats import TierStats

log = logging.getLogger(__name__)


def fail_fast_redis(url: str, timeout_s: float):
    """A redis-py client that neither retries nor waits long."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


class Pinger(Protocol):
    def ping(self) -> object: ...

    def close(self) -> None: ...


class RedisHealth:
    """Owns the probe of one Redis tier and its up/down state."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        check_interval_s: float,
        retry_interval_s: float,
        stats: TierStats,
        on_probe: Callable[[bool], None],
        clock: Callable[[], float] = time.monotonic,
        probe: Pinger | None = None,  # a fail-fast client of `url` by default
    ) -> None:
        self.url = url
        self._probe = probe if probe is not None else fail_fast_redis(url, timeout_s)
        self._check_interval_s = check_interval_s
        self._retry_interval_s = retry_interval_s
        self._stats = stats
        self._on_probe = on_probe  # told up (True) or down (False) after every probe
        self._clock = clock
        self.up = True
        self._next_check = 0.0

    def check(self, force: bool = False) -> bool:
        """Probe when due (or `force`); returns whether Redis is usable now."""
        now = self._clock()
        if not force and now < self._next_check:
            if not self.up:
                self._stats.skipped += 1
            return self.up
        import redis

        error = self._ping()
        if isinstance(error, redis.exceptions.TimeoutError):
            error = self._ping()  # once more: slow is not down
        up = error is None
        if not up:
            self._stats.errors += 1
            if self.up:
                log.warning("KV tier: Redis at %s unreachable, skipping it: %s", self.url, error)
        if up and not self.up:
            log.info("KV tier: Redis at %s is back", self.url)
        self.up = up
        self._next_check = now + (self._check_interval_s if up else self._retry_interval_s)
        self._on_probe(up)
        if not up:
            self._stats.skipped += 1
        return up

    def _ping(self) -> Exception | None:
        """None when Redis answered; the failure otherwise."""
        try:
            self._probe.ping()
            return None
        except Exception as exc:  # noqa: BLE001 - any failure means "down" (a timeout, once retried)
            return exc

    def close(self) -> None:
        self._probe.close()
