"""A prefill replica's KV events, kept for the routers that mirror its prefix cache.

The block pool emits `BlockStored` / `BlockRemoved` / `AllBlocksCleared`; this
replica publishes them in one of two ways (`router.prefix_index`; the routers'
side is routing/router/serve_routers.py):

- `KVEventLog` (``router.prefix_index: memory``): a sequence-numbered log the
  replica ships in its routing stats. Each router keeps its own cursor, so any
  number of routers read it without consuming it. When the log grows past
  `max_hashes` it is compacted into two events, `AllBlocksCleared` followed by one
  `BlockStored` holding every hash the pool caches now: a router that fell behind
  (or just started) replays from the compaction point and is exact again.
- Redis (``router.prefix_index: redis``): the replica applies its own events to
  the shared `RedisPrefixIndex`, so there is exactly one writer per replica and any
  number of routers read.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from engine.hashing import BlockHash
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True, slots=True)
class KVLogWindow:
    """What a router reads: events with sequence numbers `base`, `base + 1`, ...
    `epoch` changes when the replica (and its log) restarts."""

    epoch: str
    base: int
    events: tuple[KVEvent, ...]

    @property
    def end(self) -> int:
        return self.base + len(self.events)


class KVEventLog:
    """Owns one replica's event log; not thread-safe (one publisher thread)."""

    def __init__(self, block_size: int, max_hashes: int = 4096) -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self.block_size = block_size
        self.max_hashes = max_hashes
        self._base = 0
        self._events: list[KVEvent] = []
        self._num_hashes = 0
        self._cached: dict[BlockHash, None] = {}  # insertion-ordered set

    def extend(self, events: list[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._cached.update(dict.fromkeys(ev.block_hashes))
                self._num_hashes += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._cached.pop(h, None)
                self._num_hashes += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._cached.clear()
            self._events.append(ev)
        if self._num_hashes > self.max_hashes and len(self._events) > 2:
            self._compact()

    def _compact(self) -> None:
        self._base += len(self._events)
        hashes = tuple(self._cached)
        self._events = [AllBlocksCleared(), BlockStored(hashes, None, len(hashes) * self.block_size)]
        self._num_hashes = len(hashes)

    def window(self) -> KVLogWindow:
        return KVLogWindow(self.epoch, self._base, tuple(self._events))

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def leading_cached(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of `block_hashes`, from the first, this replica holds."""
        n = 0
        for h in block_hashes:
            if h not in self._cached:
                break
            n += 1
        return n

    @property
    def end(self) -> int:
        """The sequence number the next event gets (grows across compactions)."""
        return self._base + len(self._events)


def events_after(window: KVLogWindow, cursor: tuple[str, int] | None) -> tuple[list[KVEvent], bool]:
    """Events a router at `cursor` (epoch, next seq) has not applied yet, and whether
    it must first forget this replica (a new epoch: the replica restarted)."""
    if cursor is None or cursor[0] != window.epoch:
        return list(window.events), cursor is not None
    nxt = cursor[1]
    if nxt < window.base:  # compacted past us: the window starts with a clear
        return list(window.events), False
    return list(window.events[nxt - window.base :]), False
