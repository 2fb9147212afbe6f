"""The prefill side's table of KV leases.

NOTE (the lease invariant): a block exported in a KVHandle is leased. A leased block
is neither freed nor overwritten until exactly one of three things happens:
  1. decode releases it (``release``: it has its copy),
  2. decode rejects it (``reject``: it will never read it), or
  3. the lease expires (``expire``: decode never answered within ``ttl_s``).
Whichever comes first calls ``free_blocks(block_ids)`` exactly once and removes the
lease; the other two then find nothing and return False. ``free_blocks`` is the
engine block pool's unpin: the blocks stay as evictable prefix cache.

A late pull after expiry may read blocks the engine has reused; decode guards
against that by refusing handles whose ``lease_expiry`` has passed, and the TTL
should exceed the longest expected gap between prefill finishing and decode pulling.

Thread-safety: the deployment calls this from its asyncio loop (release/reject
messages) and the engine thread (grant, expiry sweeps), so one lock guards the
table. ``free_blocks`` runs outside the lock so a slow pool cannot stall grants.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

Clock = Callable[[], float]
FreeBlocks = Callable[[tuple[int, ...]], None]

DEFAULT_LEASE_TTL_S = 30.0


class LeaseEnd(StrEnum):
    RELEASED = "released"
    REJECTED = "rejected"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Lease:
    """One request's pin on its exported blocks; ``expiry`` is on the table's clock."""

    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    granted_at: float
    expiry: float


@dataclass(frozen=True)
class LeaseCounters:
    granted: int = 0
    released: int = 0
    rejected: int = 0
    expired: int = 0

    @property
    def active(self) -> int:
        return self.granted - self.released - self.rejected - self.expired


class LeaseTable:
    """Owns every live lease of one prefill replica and the single free of each.

    ``clock`` defaults to ``time.time`` (wall clock) because lease expiries travel in
    KVHandles to other hosts; tests inject a fake clock.
    """

    def __init__(
        self,
        free_blocks: FreeBlocks,
        *,
        default_ttl_s: float = DEFAULT_LEASE_TTL_S,
        clock: Clock = time.time,
    ) -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be positive, got {default_ttl_s}")
        self._free_blocks = free_blocks
        self._default_ttl_s = default_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._by_request: dict[str, str] = {}
        self._counts = {"granted": 0, **{end.value: 0 for end in LeaseEnd}}

    def grant(self, request_id: str, block_ids: Sequence[int], ttl_s: float | None = None) -> Lease:
        """Pin ``block_ids`` for ``request_id`` until release, reject or expiry."""
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl}")
        now = self._clock()
        lease = Lease(uuid.uuid4().hex, request_id, tuple(int(b) for b in block_ids), now, now + ttl)
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"request {request_id!r} already holds lease {self._by_request[request_id]}")
            self._leases[lease.lease_id] = lease
            self._by_request[request_id] = lease.lease_id
            self._counts["granted"] += 1
        return lease

    def release(self, lease_id: str) -> bool:
        """Decode has its copy. False (and nothing freed) if the lease is unknown or already ended."""
        return self._end(lease_id, LeaseEnd.RELEASED) is not None

    def reject(self, lease_id: str) -> bool:
        """Decode will not read the blocks. False if the lease is unknown or already ended."""
        return self._end(lease_id, LeaseEnd.REJECTED) is not None

    def expire(self, now: float | None = None) -> list[Lease]:
        """End every lease whose expiry has passed; returns them. Call periodically."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [lease for lease in self._leases.values() if lease.expiry <= now]
            for lease in due:
                self._pop_locked(lease.lease_id, LeaseEnd.EXPIRED)
        for lease in due:
            self._free_blocks(lease.block_ids)
        return due

    def lease_for(self, request_id: str) -> Lease | None:
        """The live lease of a request (the exporter builds its handle from it)."""
        with self._lock:
            lease_id = self._by_request.get(request_id)
            return self._leases.get(lease_id) if lease_id else None

    def active(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def counters(self) -> LeaseCounters:
        with self._lock:
            return LeaseCounters(**self._counts)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _end(self, lease_id: str, end: LeaseEnd) -> Lease | None:
        with self._lock:
            lease = self._pop_locked(lease_id, end)
        if lease is not None:
            self._free_blocks(lease.block_ids)
        return lease

    def _pop_locked(self, lease_id: str, end: LeaseEnd) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        del self._by_request[lease.request_id]
        self._counts[end.value] += 1
        return lease
