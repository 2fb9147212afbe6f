"""Prefix index: block hash → replicas holding it, fed only by KV events.

The block pools emit `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
(engine/kv_events.py); the router applies them here and asks `match()` how many
leading blocks of a prompt each replica holds. The index never guesses: a
routing decision does not insert anything.

Two implementations share the `PrefixIndex` interface:

- `InProcessPrefixIndex`: dicts in the router process (default).
- `RedisPrefixIndex`: the same two maps in Redis, so several routers share one
  view and a router restart keeps it. Redis errors are counted and logged and
  never raised: `match()` then returns {} and the router routes by load alone.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from engine.hashing import BlockHash
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvtransfer.events.config import PrefixIndexConfig

log = logging.getLogger(__name__)


class PrefixIndex(abc.ABC):
    """Which replica caches which block, as reported by the replicas' KV events."""

    @abc.abstractmethod
    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one replica's events, in emission order."""

    @abc.abstractmethod
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Replica id → length of the leading run of `block_hashes` it holds (> 0 only)."""

    @abc.abstractmethod
    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica that died or scaled away, and all its blocks."""

    @abc.abstractmethod
    def replicas(self) -> set[str]:
        """Replicas that reported events and were not removed."""

    def close(self) -> None:  # noqa: B027 - optional: only an index with connections overrides it
        """Release connections; the in-process index holds none."""


def _leading_runs(holders_per_block: Iterable[set[str]]) -> dict[str, int]:
    """Per replica, how many blocks from the start it holds without a gap."""
    result: dict[str, int] = {}
    alive: set[str] | None = None
    depth = 0
    for holders in holders_per_block:
        nxt = set(holders) if alive is None else alive & holders
        if alive is not None:
            for rid in alive - nxt:
                result[rid] = depth
        alive = nxt
        if not alive:
            return result
        depth += 1
    for rid in alive or ():
        result[rid] = depth
    return result


class InProcessPrefixIndex(PrefixIndex):
    """Both maps in this process; O(blocks) per event batch and per match."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._by_replica: dict[str, set[BlockHash]] = {}

    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        mine = self._by_replica.setdefault(replica_id, set())
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self._holders.setdefault(h, set()).add(replica_id)
                    mine.add(h)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._drop(h, replica_id)
                    mine.discard(h)
            elif isinstance(ev, AllBlocksCleared):
                for h in mine:
                    self._drop(h, replica_id)
                mine.clear()
            else:
                raise TypeError(f"not a KV event: {ev!r}")

    def _drop(self, h: BlockHash, replica_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._holders[h]

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        empty: set[str] = set()
        return _leading_runs(self._holders.get(h, empty) for h in block_hashes)

    def remove_replica(self, replica_id: str) -> None:
        for h in self._by_replica.pop(replica_id, set()):
            self._drop(h, replica_id)

    def replicas(self) -> set[str]:
        return set(self._by_replica)

    def num_blocks(self) -> int:
        return len(self._holders)


def fail_fast_client(url: str, timeout_s: float):
    """A redis-py client that neither retries nor waits long: the router's
    fallback to load-only routing is cheaper than a stalled request."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


class RedisPrefixIndex(PrefixIndex):
    """The index in Redis, shared by every router pointed at the same `key_prefix`.

    Keys: ``{p}:h:{hash hex}`` → set of replica ids; ``{p}:r:{replica}`` → set of
    its hashes (so removing a replica costs O(its blocks)); ``{p}:replicas`` →
    set of replica ids. Set ops are idempotent, so several routers may apply the
    same events.

    On a Redis error the call is skipped (counted in `errors`, logged) and Redis
    is not tried again for `retry_interval_s`, so an outage costs one socket
    timeout per interval, not one per request. Events that could not be applied
    are buffered (up to `max_pending_events`) and replayed on recovery; if the
    buffer overflows, the replica's entries are cleared on recovery rather than
    left stale.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6390/0",
        key_prefix: str = "duet:prefix",
        socket_timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        max_pending_events: int = 100_000,
        match_batch: int = 64,
        client=None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import redis

        self._redis_errors = (redis.RedisError, OSError)
        self._client = client or fail_fast_client(url, socket_timeout_s)
        self._p = key_prefix
        self._retry_interval = retry_interval_s
        self._max_pending = max_pending_events
        self._match_batch = match_batch
        self._clock = clock
        self._down_until = 0.0
        self._pending: list[tuple[str, list[KVEvent]]] = []
        self._num_pending = 0
        self._overflowed: set[str] = set()  # cleared on recovery: events were lost
        self._removed: set[str] = set()  # removed while Redis was down
        self.errors = 0

    def _hkey(self, h: BlockHash) -> str:
        return f"{self._p}:h:{h.hex()}"

    def _rkey(self, replica_id: str) -> str:
        return f"{self._p}:r:{replica_id}"

    @property
    def healthy(self) -> bool:
        return self._clock() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors += 1
        self._down_until = self._clock() + self._retry_interval
        log.warning("prefix index: Redis %s failed (%d errors so far): %s", what, self.errors, exc)

    def _usable(self) -> bool:
        """Whether to talk to Redis now; replays what an outage left behind first."""
        if not self.healthy:
            return False
        if self._pending or self._overflowed or self._removed:
            try:
                self._flush()
            except self._redis_errors as exc:
                self._failed("replay", exc)
                return False
        return True

    def _flush(self) -> None:
        for rid in sorted(self._removed):
            self._clear_replica(rid, forget=True)
            self._removed.discard(rid)
        for rid in sorted(self._overflowed):
            self._clear_replica(rid, forget=False)
            self._overflowed.discard(rid)
        while self._pending:
            rid, events = self._pending[0]
            self._write(rid, events)
            self._pending.pop(0)
            self._num_pending -= len(events)

    def _buffer(self, replica_id: str, events: list[KVEvent]) -> None:
        """Keep events for replay. Replaying from the start is safe: the last op on
        each hash decides its membership, whatever part was applied before."""
        if replica_id in self._overflowed or not events:
            return
        if self._num_pending + len(events) > self._max_pending:
            self._drop_pending(replica_id)
            self._overflowed.add(replica_id)
            log.warning("prefix index: event buffer full; %s is cleared on recovery", replica_id)
            return
        self._pending.append((replica_id, events))
        self._num_pending += len(events)

    def _drop_pending(self, replica_id: str) -> None:
        self._pending = [(r, evs) for r, evs in self._pending if r != replica_id]
        self._num_pending = sum(len(evs) for _, evs in self._pending)

    def _write(self, replica_id: str, events: list[KVEvent]) -> None:
        """Apply events in order: stores and removes pipelined, a clear between pipelines."""
        rkey = self._rkey(replica_id)
        pipe = self._client.pipeline(transaction=False)
        pipe.sadd(f"{self._p}:replicas", replica_id)
        for ev in events:
            if isinstance(ev, BlockStored) and ev.block_hashes:
                for h in ev.block_hashes:
                    pipe.sadd(self._hkey(h), replica_id)
                pipe.sadd(rkey, *ev.block_hashes)
            elif isinstance(ev, BlockRemoved) and ev.block_hashes:
                for h in ev.block_hashes:
                    pipe.srem(self._hkey(h), replica_id)
                pipe.srem(rkey, *ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                pipe.execute()
                self._clear_replica(replica_id, forget=False)
                pipe = self._client.pipeline(transaction=False)
        pipe.execute()

    def _clear_replica(self, replica_id: str, forget: bool) -> None:
        rkey = self._rkey(replica_id)
        hashes = self._client.smembers(rkey)
        pipe = self._client.pipeline(transaction=False)
        for h in hashes:
            pipe.srem(self._hkey(h), replica_id)
        pipe.delete(rkey)
        if forget:
            pipe.srem(f"{self._p}:replicas", replica_id)
        else:
            pipe.sadd(f"{self._p}:replicas", replica_id)
        pipe.execute()

    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        events = list(events)
        for ev in events:
            if not isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)):
                raise TypeError(f"not a KV event: {ev!r}")
        if not self._usable():
            self._buffer(replica_id, events)
            return
        try:
            self._write(replica_id, events)
        except self._redis_errors as exc:
            self._failed("apply", exc)
            self._buffer(replica_id, events)

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not block_hashes or not self._usable():
            return {}
        try:
            holders: list[set[str]] = []
            for start in range(0, len(block_hashes), self._match_batch):
                pipe = self._client.pipeline(transaction=False)
                for h in block_hashes[start : start + self._match_batch]:
                    pipe.smembers(self._hkey(h))
                batch = [{m.decode() for m in ms} for ms in pipe.execute()]
                holders.extend(batch)
                if any(not b for b in batch):
                    break  # the leading run cannot extend past an empty block
            return _leading_runs(holders)
        except self._redis_errors as exc:
            self._failed("match", exc)
            return {}

    def remove_replica(self, replica_id: str) -> None:
        self._drop_pending(replica_id)
        self._overflowed.discard(replica_id)
        if self._usable():
            try:
                self._clear_replica(replica_id, forget=True)
                return
            except self._redis_errors as exc:
                self._failed("remove_replica", exc)
        self._removed.add(replica_id)

    def replicas(self) -> set[str]:
        if not self._usable():
            return set()
        try:
            return {m.decode() for m in self._client.smembers(f"{self._p}:replicas")}
        except self._redis_errors as exc:
            self._failed("replicas", exc)
            return set()

    def clear(self) -> None:
        """Delete every key under this index's prefix (tests, a fresh cluster)."""
        for key in self._client.scan_iter(match=f"{self._p}:*", count=1000):
            self._client.delete(key)

    def close(self) -> None:
        try:
            self._client.close()
        except self._redis_errors:
            pass


def make_prefix_index(cfg: PrefixIndexConfig) -> PrefixIndex:
    """The index `cfg` names: a fresh in-process one, or a client of the shared Redis one."""
    if cfg.prefix_index == "redis":
        return RedisPrefixIndex(cfg.redis_url, key_prefix=cfg.index_key_prefix)
    return InProcessPrefixIndex()
