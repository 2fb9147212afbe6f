"""Whether the Redis tier answers: a fail-fast probe, re-checked on an interval.

Redis is optional at runtime. While it does not answer, the tier bypasses its
LMCache backend (CPU and disk keep working) and probes again every
`redis_retry_interval_s`, so an outage costs one short timeout per interval rather
than one per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

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
    ) -> None:
        self.url = url
        self._probe = fail_fast_redis(url, timeout_s)
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
        try:
            self._probe.ping()
            up = True
        except Exception as exc:  # noqa: BLE001 - any failure means "down"
            up = False
            self._stats.errors += 1
            if self.up:
                log.warning("KV tier: Redis at %s unreachable, skipping it: %s", self.url, exc)
        if up and not self.up:
            log.info("KV tier: Redis at %s is back", self.url)
        self.up = up
        self._next_check = now + (self._check_interval_s if up else self._retry_interval_s)
        self._on_probe(up)
        if not up:
            self._stats.skipped += 1
        return up

    def close(self) -> None:
        self._probe.close()
