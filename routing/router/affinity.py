"""Session affinity: which prefill replica an `x-session-id` last used.

Only a hint for `choose_prefill` (a cost bonus), never a rule. Bounded LRU with
a TTL so a router serving many sessions keeps a fixed footprint.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class SessionAffinity:
    """Owns the session id → replica id map of one router process."""

    def __init__(
        self,
        max_sessions: int = 100_000,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions <= 0:
            raise ValueError(f"max_sessions must be > 0, got {max_sessions}")
        self._max = max_sessions
        self._ttl = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def get(self, session_id: str | None) -> str | None:
        if not session_id:
            return None
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        replica_id, at = entry
        if self._clock() - at > self._ttl:
            del self._entries[session_id]
            return None
        return replica_id

    def record(self, session_id: str | None, replica_id: str) -> None:
        if not session_id:
            return
        self._entries[session_id] = (replica_id, self._clock())
        self._entries.move_to_end(session_id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def remove_replica(self, replica_id: str) -> None:
        for sid in [s for s, (r, _) in self._entries.items() if r == replica_id]:
            del self._entries[sid]

    def __len__(self) -> int:
        return len(self._entries)
