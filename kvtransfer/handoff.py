"""The two ends of a handoff, as one call each: export (prefill) and pull (decode).

These glue the lease table, the layout fingerprint and a backend together so the
deployments do not re-implement the checks: a handle whose lease has run out, or
whose layout or backend differs, is refused before any byte moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtransfer.backends.base import KVTransferBackend, TransferError, TransferStats
from kvtransfer.lease import LeaseTable
from kvtransfer.messages import KVHandle

# Stop pulling this long before the lease ends: the prefill may free (and the
# engine reuse) the blocks the instant it expires, and clocks differ across hosts.
LEASE_SAFETY_MARGIN_S = 1.0


class LeaseExpired(TransferError):
    """The handle's lease ran out (or would during the pull); its blocks may be reused."""


class BackendMismatch(TransferError):
    """The handle was exported by a different transfer backend than this replica runs."""


def export_kv(
    backend: KVTransferBackend,
    leases: LeaseTable,
    *,
    request_id: str,
    prefill_replica_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    ttl_s: float | None = None,
    control_address: tuple[str, int] | None = None,
) -> KVHandle:
    """Prefill side: lease ``block_ids`` and describe them for a decode replica.

    The blocks must already hold the request's KV; from here they stay pinned until
    Release, Reject or expiry (see ``kvtransfer.lease``).
    """
    lease = leases.grant(request_id, block_ids, ttl_s)
    try:
        return KVHandle(
            request_id=request_id,
            prefill_replica_id=prefill_replica_id,
            backend=backend.name,
            peer=backend.peer_info(),
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            fingerprint=backend.fingerprint,
            lease_id=lease.lease_id,
            lease_expiry=lease.expiry,
            control_address=control_address,
        )
    except Exception:
        leases.reject(lease.lease_id)  # a handle nobody can use must not pin blocks
        raise


def pull_kv(
    backend: KVTransferBackend,
    handle: KVHandle,
    local_block_ids: Sequence[int],
    *,
    timeout_s: float = 10.0,
    clock: Callable[[], float] = time.time,
) -> TransferStats:
    """Decode side: copy the handle's blocks into ``local_block_ids`` (same order).

    Raises ``LayoutMismatch``, ``BackendMismatch``, ``LeaseExpired`` or another
    ``TransferError``; the caller then sends ``Reject`` (prefill frees at once) and
    frees its own blocks. On success the caller sends ``Release``.
    """
    if handle.backend != backend.name:
        raise BackendMismatch(f"handle from backend {handle.backend!r}, this replica runs {backend.name!r}")
    backend.fingerprint.check_compatible(handle.fingerprint)
    lease_left = handle.seconds_left(clock()) - LEASE_SAFETY_MARGIN_S
    if lease_left <= 0:
        raise LeaseExpired(f"lease {handle.lease_id} of {handle.request_id} has expired")
    if len(local_block_ids) != handle.num_blocks:
        raise ValueError(f"handle has {handle.num_blocks} blocks, got {len(local_block_ids)} local blocks")
    try:
        return backend.pull(handle.peer, handle.block_ids, local_block_ids, min(timeout_s, lease_left))
    except TransferError as exc:
        if lease_left < timeout_s and handle.seconds_left(clock()) <= LEASE_SAFETY_MARGIN_S:
            raise LeaseExpired(f"lease {handle.lease_id} ran out during the pull: {exc}") from exc
        raise
