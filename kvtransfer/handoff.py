"""The two ends of a handoff, and the only code that builds or checks a `KVHandle`.

Prefill side: `KVExporter` owns the replica's lease table, its control port (where
decode's `Release` / `Reject` arrive) and the sweeper that expires forgotten
leases; it turns a finished request's pinned blocks into a handle.
Decode side: `check_handle` refuses a handle before any block is reserved,
`pull_kv` copies the blocks, and `release_lease` / `reject_lease` end the lease.

A handle whose lease has (nearly) run out, or whose layout or backend differs, is
refused before any byte moves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtransfer import control
from kvtransfer.backends.base import KVTransferBackend, TransferError, TransferStats
from kvtransfer.lease import FreeBlocks, Lease, LeaseTable
from kvtransfer.messages import KVHandle, Reject, RejectReason, Release

log = logging.getLogger(__name__)

# Stop pulling this long before the lease ends: the prefill may free (and the
# engine reuse) the blocks the instant it expires, and clocks differ across hosts.
LEASE_SAFETY_MARGIN_S = 1.0
# How often the prefill side looks for expired leases.
SWEEP_INTERVAL_S = 0.25


class LeaseExpired(TransferError):
    """The handle's lease ran out (or would during the pull); its blocks may be reused."""


class BackendMismatch(TransferError):
    """The handle was exported by a different transfer backend than this replica runs."""


class PeerMismatch(TransferError):
    """The handle's transfer peer is not the replica that granted its lease."""


# ---------------------------------------------------------------- prefill side
def make_handle(
    backend: KVTransferBackend,
    lease: Lease,
    *,
    prefill_replica_id: str,
    num_tokens: int,
    control_server: control.ControlServer | None = None,
) -> KVHandle:
    """Describe a leased set of blocks for a decode replica; with the owner's
    `control_server`, the handle says where and how to end the lease."""
    return KVHandle(
        request_id=lease.request_id,
        prefill_replica_id=prefill_replica_id,
        backend=backend.name,
        peer=backend.peer_info(),
        block_ids=lease.block_ids,
        num_tokens=num_tokens,
        fingerprint=backend.fingerprint,
        lease_id=lease.lease_id,
        lease_expiry=lease.expiry,
        control_address=(control_server.host, control_server.port) if control_server else None,
        control_key=control_server.lease_key(lease.lease_id).hex() if control_server else None,
    )


def export_kv(
    backend: KVTransferBackend,
    leases: LeaseTable,
    *,
    request_id: str,
    prefill_replica_id: str,
    block_ids: Sequence[int],
    num_tokens: int,
    ttl_s: float | None = None,
    control_server: control.ControlServer | None = None,
) -> KVHandle:
    """Lease ``block_ids`` and describe them for a decode replica.

    The blocks must already hold the request's KV; from here they stay pinned until
    Release, Reject or expiry (see ``kvtransfer.lease``).
    """
    lease = leases.grant(request_id, block_ids, ttl_s)
    try:
        return make_handle(
            backend, lease, prefill_replica_id=prefill_replica_id, num_tokens=num_tokens,
            control_server=control_server,
        )
    except Exception:
        leases.reject(lease.lease_id)  # a handle nobody can use must not pin blocks
        raise


class KVExporter:
    """Owns one prefill replica's side of every handoff: leases, control port, sweeper.

    ``free_blocks`` unpins blocks in the engine (they stay as prefix cache); it is
    called exactly once per lease, from whichever of release, reject or expiry
    comes first.
    """

    def __init__(
        self,
        backend: KVTransferBackend,
        replica_id: str,
        free_blocks: FreeBlocks,
        *,
        lease_ttl_s: float,
        host: str,
    ) -> None:
        self.backend = backend
        self.replica_id = replica_id
        self.lease_ttl_s = lease_ttl_s
        self.leases = LeaseTable(free_blocks, default_ttl_s=lease_ttl_s)
        self.control = control.ControlServer(self._on_control, host=host)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="lease-sweeper", daemon=True)
        self._sweeper.start()

    def grant(self, request_id: str, block_ids: Sequence[int]) -> Lease:
        """Pin a finished request's blocks; call it where the request finishes (the
        engine thread), so no cancelled await can leave them unleased."""
        return self.leases.grant(request_id, block_ids)

    def withdraw(self, request_id: str) -> bool:
        """End the lease of a request whose caller left before it got the handle (the
        engine may have finished and granted it just before): nobody can pull it."""
        lease = self.leases.lease_for(request_id)
        return lease is not None and self.leases.reject(lease.lease_id)

    def handle_for(self, request_id: str, num_tokens: int) -> KVHandle:
        """The handle of a request whose blocks `grant` pinned."""
        lease = self.leases.lease_for(request_id)
        if lease is None:
            raise RuntimeError(f"{request_id}: prefill finished but holds no lease")
        return make_handle(
            self.backend, lease, prefill_replica_id=self.replica_id, num_tokens=num_tokens,
            control_server=self.control,
        )

    def _on_control(self, msg: control.ControlMessage) -> None:
        if isinstance(msg, Release):
            self.leases.release(msg.lease_id)
        else:
            self.leases.reject(msg.lease_id)

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            for lease in self.leases.expire():
                log.warning("lease %s of %s expired: blocks freed", lease.lease_id, lease.request_id)

    def stats(self) -> dict[str, int]:
        counters = self.leases.counters()
        return {
            "leases_active": len(self.leases),
            "leases_granted": counters.granted,
            "leases_released": counters.released,
            "leases_rejected": counters.rejected,
            "leases_expired": counters.expired,
            **self.control.stats(),
        }

    def drain(self, timeout_s: float) -> int:
        """Wait until every granted lease has ended (released, rejected or expired), at
        most `timeout_s`; returns how many are still active. Grant nothing meanwhile."""
        deadline = time.monotonic() + timeout_s
        while len(self.leases) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.leases)

    def close(self) -> None:
        self._stop.set()
        self.control.close()


# ---------------------------------------------------------------- decode side
def check_handle(backend: KVTransferBackend, handle: KVHandle, clock: Callable[[], float] = time.time) -> float:
    """Refuse a handle this replica must not pull; returns the seconds a pull may take.

    Raises ``BackendMismatch``, ``LayoutMismatch`` or ``LeaseExpired``.
    """
    if handle.backend != backend.name:
        raise BackendMismatch(f"handle from backend {handle.backend!r}, this replica runs {backend.name!r}")
    backend.fingerprint.check_compatible(handle.fingerprint)
    # The peer must be the replica that granted the lease, with the layout it claims:
    # its backend instance id is `<replica id>-<random>` (a restarted replica is a new peer).
    backend.fingerprint.check_compatible(handle.peer.fingerprint)
    peer, owner = handle.peer.peer_id, handle.prefill_replica_id
    if peer != owner and not peer.startswith(f"{owner}-"):
        raise PeerMismatch(f"peer {handle.peer.peer_id!r} is not replica {handle.prefill_replica_id!r}")
    lease_left = handle.seconds_left(clock()) - LEASE_SAFETY_MARGIN_S
    if lease_left <= 0:
        raise LeaseExpired(f"lease {handle.lease_id} of {handle.request_id} has expired")
    return lease_left


def pull_kv(
    backend: KVTransferBackend,
    handle: KVHandle,
    local_block_ids: Sequence[int],
    *,
    timeout_s: float = 10.0,
    clock: Callable[[], float] = time.time,
) -> TransferStats:
    """Copy the handle's blocks into ``local_block_ids`` (same order).

    Raises what `check_handle` raises, or another ``TransferError``; the caller then
    rejects the lease (prefill frees at once) and frees its own blocks. On success
    the caller releases the lease.
    """
    lease_left = check_handle(backend, handle, clock)
    if len(local_block_ids) != handle.num_blocks:
        raise ValueError(f"handle has {handle.num_blocks} blocks, got {len(local_block_ids)} local blocks")
    try:
        return backend.pull(handle.peer, handle.block_ids, local_block_ids, min(timeout_s, lease_left))
    except TransferError as exc:
        if lease_left < timeout_s and handle.seconds_left(clock()) <= LEASE_SAFETY_MARGIN_S:
            raise LeaseExpired(f"lease {handle.lease_id} ran out during the pull: {exc}") from exc
        raise


def release_lease(handle: KVHandle, timeout_s: float) -> bool:
    """Tell the owner decode has its copy; False when it could not be told (the lease then expires)."""
    return _notify(handle, Release(handle.request_id, handle.lease_id), timeout_s)


def reject_lease(handle: KVHandle, reason: RejectReason, timeout_s: float) -> bool:
    """Tell the owner nobody will read the blocks, so it frees them now rather than at expiry."""
    return _notify(handle, Reject(handle.request_id, handle.lease_id, reason.value), timeout_s)


def _notify(handle: KVHandle, msg: control.ControlMessage, timeout_s: float) -> bool:
    if handle.control_address is None or handle.control_key is None:
        return False
    return control.send(tuple(handle.control_address), msg, bytes.fromhex(handle.control_key), timeout_s=timeout_s)
