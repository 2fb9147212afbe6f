"""Who may use the gateway, and how much: API keys and per-key limits.

Keys come from `DUET_API_KEYS` (comma-separated) and from `gateway.api_keys_file`
(one per line, `#` comments). No key configured means an open gateway, as before.
A presented key is compared with every accepted key in constant time; from then on
the gateway knows the caller by a key id (a digest prefix), never by the key.

Per key: requests in flight (`max_in_flight_per_key`) and a token budget per minute
(`tokens_per_minute_per_key`: prompt + max_tokens, a token bucket refilled
continuously). Over either, a 429 with `Retry-After`. Pure code over a clock, so it
is unit-tested without a server.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from routing.openai.errors import RATE_LIMIT, APIError, headers_too_large, payload_too_large, unauthorized

KEYS_ENV = "DUET_API_KEYS"
ANONYMOUS = "-"  # the key id of every caller of an open gateway


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class APIKeys:
    """Owns the set of accepted keys (as bytes, for constant-time comparison)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in dict.fromkeys(k.strip() for k in keys) if k]

    @classmethod
    def load(cls, path: str | None, env: Mapping[str, str] = os.environ) -> APIKeys:
        keys = [k for k in env.get(KEYS_ENV, "").split(",")]
        if path:
            for line in Path(path).read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.append(line)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key id from an `Authorization: Bearer <key>` header; 401 otherwise."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, presented = (authorization or "").partition(" ")
        token = presented.strip().encode() if scheme.lower() == "bearer" else b""
        match = False
        for k in self._keys:  # no early exit: the time taken says nothing about which key
            match |= hmac.compare_digest(k, token)
        if not token or not match:
            raise unauthorized()
        return key_id(token.decode())


def cache_salt(isolation: str, key: str, requested: str | None) -> str | None:
    """A request's KV namespace (engine/hashing.py `chain_root`) from the gateway's
    `cache_isolation`, the caller's key id and the request's own `cache_salt`.

    Under `per_key` the key comes first and a requested salt only narrows it, so no
    request can name its way into another key's namespace. The prefixes keep every
    combination distinct from every other."""
    if isolation == "per_key":
        return f"key={key};salt={requested or ''}"
    return f"salt={requested}" if requested else None


def rate_limited(message: str, retry_after_s: float) -> APIError:
    return APIError(429, message, RATE_LIMIT, None, "rate_limit_exceeded",
                    {"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class KeyLimiter:
    """Owns each key's requests in flight and token bucket (thread-safe)."""

    def __init__(
        self,
        max_in_flight: int | None = None,
        tokens_per_minute: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens left, at)

    def check(self, key: str) -> None:
        """429 if `key` has no request slot free now (reserves nothing)."""
        with self._lock:
            self._check_slot(key)

    def charge(self, key: str, tokens: int) -> None:
        """Take `tokens` from the key's budget, or raise 429 (taking nothing)."""
        if self.tokens_per_minute is None:
            return
        rate = self.tokens_per_minute / 60.0
        with self._lock:
            now = self._clock()
            left, at = self._buckets.get(key, (float(self.tokens_per_minute), now))
            left = min(float(self.tokens_per_minute), left + (now - at) * rate)
            if tokens > self.tokens_per_minute:
                raise rate_limited(
                    f"This request needs {tokens} tokens (prompt + max_tokens); the key's budget is "
                    f"{self.tokens_per_minute} tokens per minute.", 60.0)
            if tokens > left:
                self._buckets[key] = (left, now)
                raise rate_limited(
                    f"Token budget exceeded ({self.tokens_per_minute} tokens per minute); retry later.",
                    (tokens - left) / rate)
            self._buckets[key] = (left - tokens, now)

    def acquire(self, key: str) -> None:
        """Take a request slot for `key`, or raise 429; pair with `release`."""
        with self._lock:
            self._check_slot(key)
            self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def release(self, key: str) -> None:
        with self._lock:
            n = self._in_flight.get(key, 0) - 1
            if n > 0:
                self._in_flight[key] = n
            else:
                self._in_flight.pop(key, None)

    def in_flight(self, key: str) -> int:
        with self._lock:
            return self._in_flight.get(key, 0)

    def _check_slot(self, key: str) -> None:
        if self.max_in_flight is not None and self._in_flight.get(key, 0) >= self.max_in_flight:
            raise rate_limited(f"Too many requests in flight for this key (limit {self.max_in_flight}).", 1.0)


def check_headers(raw: list[tuple[bytes, bytes]], max_bytes: int, max_count: int) -> None:
    """431 when a request carries more than `max_count` header fields or `max_bytes`
    of them (names + values): the proxy in front caps each line, not the total."""
    if len(raw) > max_count:
        raise headers_too_large(f"{len(raw)} fields (limit {max_count})")
    size = sum(len(k) + len(v) for k, v in raw)
    if size > max_bytes:
        raise headers_too_large(f"{size} bytes (limit {max_bytes})")


async def read_body(request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise payload_too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise payload_too_large(max_bytes)
    return bytes(body)
