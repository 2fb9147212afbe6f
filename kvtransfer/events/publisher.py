"""A replica's side of the prefix index: drain its block pool's KV events and publish
them, to the event log its routing stats carry (`memory`) and, with `redis`, to the
shared Redis index (one writer per replica)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from engine.hashing import BlockHash
from engine.kv_events import AllBlocksCleared, KVEvent
from kvtransfer.events.config import PrefixIndexConfig
from kvtransfer.events.log import KVEventLog, KVLogWindow
from kvtransfer.events.prefix_index import RedisPrefixIndex

# How often events are drained between routing-stats reports (which drain too).
PUBLISH_INTERVAL_S = 0.05


class KVEventPublisher:
    """Owns one replica's event log, its Redis writer (if any) and the draining thread."""

    def __init__(
        self,
        cfg: PrefixIndexConfig,
        block_size: int,
        replica_id: str,
        take_events: Callable[[], list[KVEvent]],
    ) -> None:
        self.replica_id = replica_id
        self.log = KVEventLog(block_size, cfg.event_log_max_hashes)
        self.redis = (
            RedisPrefixIndex(cfg.redis_url, key_prefix=cfg.index_key_prefix) if cfg.prefix_index == "redis" else None
        )
        self._take_events = take_events
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            self.drain()

    def drain(self) -> None:
        with self._lock:
            events = self._take_events()
            if not events:
                return
            self.log.extend(events)
            if self.redis is not None:
                self.redis.apply(self.replica_id, events)  # buffers and replays on outage

    def engine_replaced(self, take_events: Callable[[], list[KVEvent]]) -> None:
        """The replica's engine core was replaced by a new one, whose block pool is
        empty: publish that every block is gone, and drain the new one from now on."""
        with self._lock:
            self._take_events = take_events
            events: list[KVEvent] = [AllBlocksCleared()]
            self.log.extend(events)
            if self.redis is not None:
                self.redis.apply(self.replica_id, events)

    def window(self) -> KVLogWindow | None:
        """What the routing stats carry: the log window, or None when routers read Redis."""
        self.drain()
        return self.log.window() if self.redis is None else None

    def leading_cached(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` this replica holds, as of every event so far."""
        self.drain()
        with self._lock:
            return self.log.leading_cached(block_hashes)

    def stats(self) -> dict[str, int]:
        self.drain()
        return {
            "kv_events_cached_blocks": self.log.num_cached,
            "kv_events_seq": self.log.end,  # a router at this sequence number has every event so far
            "prefix_index_errors": self.redis.errors if self.redis is not None else 0,
        }

    def close(self) -> None:
        self._stop.set()
        if self.redis is not None:
            self.redis.close()
