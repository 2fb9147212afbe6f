"""The two ends of a handoff, and the only code that builds or checks a `KVHandle`.

Prefill side: `KVExporter` owns the replica's lease table, its control port (where
decode's `Release` / `Reject` arrive) and the sweeper that expires forgotten
leases; it turns a finished request's pinned blocks into a handle.
Decode side: `KVImporter` owns the replica's side of every import: it checks the
handle (`check_handle`) before any block is reserved, reserves blocks (waiting within
the lease for running sequences to free some), copies them (`pull_kv`), ends the lease
(`release_lease` / `reject_lease`), and keeps custody of the blocks until the request
starts with them. An `ImportedKV` is taken exactly once: by the engine when the
request starts, or discarded (its blocks freed) by whoever gives it up.

A handle whose lease has (nearly) run out, or whose layout or backend differs, is
refused before any byte moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvtransfer import control
from kvtransfer.backends.base import KVTransferBackend, TransferError, TransferStats
from kvtransfer.layout import LayoutMismatch
from kvtransfer.lease import FreeBlocks, Lease, LeaseTable
from kvtransfer.messages import ImportFailed, KVHandle, Reject, RejectReason, Release, TraceCarrier
from telemetry import metrics, tracing
from telemetry.tracing import Span, SpanKind

log = logging.getLogger(__name__)
T = TypeVar("T")

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
    backend.expect_reads(lease.expiry - lease.granted_at)  # the lease's TTL, on the table's clock
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
        # A lease's grant or end and what the backend is told of it, as one step: told
        # out of order, a pump could idle while a new lease is being pulled.
        self._reads_lock = threading.Lock()
        self.control = control.ControlServer(self._on_control, host=host)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="lease-sweeper", daemon=True)
        self._sweeper.start()

    def grant(self, request_id: str, block_ids: Sequence[int]) -> Lease:
        """Pin a finished request's blocks; call it where the request finishes (the
        engine thread, or the engine core client's reader thread before it delivers
        the outputs), so no cancelled await can leave them unleased."""
        with self._reads_lock:
            lease = self.leases.grant(request_id, block_ids)
            self.backend.expect_reads(self.lease_ttl_s)
        return lease

    def withdraw(self, request_id: str) -> bool:
        """End the lease of a request whose caller left before it got the handle (the
        engine may have finished and granted it just before): nobody can pull it."""
        lease = self.leases.lease_for(request_id)
        return lease is not None and self._end(lambda: self.leases.reject(lease.lease_id))

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
            self._end(lambda: self.leases.release(msg.lease_id))
        else:
            self._end(lambda: self.leases.reject(msg.lease_id))

    def _end(self, end: Callable[[], T]) -> T:
        """Run `end` (a release, reject or expiry); tell the backend when no lease is left."""
        with self._reads_lock:
            ended = end()
            if not len(self.leases):
                self.backend.reads_ended()
        return ended

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            for lease in self._end(self.leases.expire):
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
    host, port = handle.control_address  # a list once it has crossed JSON
    return control.send((host, port), msg, bytes.fromhex(handle.control_key), timeout_s=timeout_s)


class ImportBlocks(Protocol):
    """The decode engine's block pool as an import uses it (`AsyncEngine`, or `EngineCoreClient` for a
    child process)."""

    async def reserve_blocks(self, num_tokens: int) -> list[int] | None: ...

    def could_ever_hold(self, num_tokens: int) -> bool: ...

    def release_blocks(self, block_ids: list[int]) -> object: ...


class ImportedKV:
    """Custody of the blocks one import filled (None: the import failed and the prompt
    is recomputed by the engine). Ends exactly once, from any thread: `take` hands the
    blocks to whoever starts the request with them; `discard` frees them."""

    def __init__(self, request_id: str, blocks: list[int] | None, importer: KVImporter) -> None:
        self.request_id = request_id
        self.since = time.monotonic()
        self._blocks = blocks
        self._importer = importer
        self._lock = threading.Lock()
        self._ended = False

    @property
    def recompute(self) -> bool:
        return self._blocks is None

    @property
    def num_blocks(self) -> int:
        return len(self._blocks or ())

    def take(self) -> list[int] | None:
        """The blocks, now the caller's to free (None: recompute). Raises if the
        custody has ended already: two owners of one block set is a bug."""
        with self._lock:
            if self._ended:
                raise RuntimeError(f"the imported KV of {self.request_id} was taken or discarded already")
            self._ended, blocks, self._blocks = True, self._blocks, None
        self._importer._ended(self)
        return blocks

    def discard(self) -> int:
        """Free the blocks unless taken; returns how many were freed."""
        with self._lock:
            if self._ended:
                return 0
            self._ended, blocks, self._blocks = True, self._blocks, None
        if blocks:
            self._importer.blocks.release_blocks(blocks)
        self._importer._ended(self)
        return len(blocks or ())


@dataclass(frozen=True)
class ImportStats:
    """One decode replica's imports so far (names as its `stats()` reports them)."""

    imports: int = 0
    import_rejects: int = 0  # no free blocks within the lease
    import_failures: int = 0  # mismatch, expired lease or failed transfer
    import_recomputes: int = 0
    imports_waiting: int = 0  # checking, reserving or pulling now
    import_blocks_held: int = 0  # filled, not yet taken by the engine
    import_held_oldest: tuple[tuple[str, float], ...] = ()  # (request id, seconds held), oldest first
    import_blocks_reclaimed: int = 0  # freed by the stale sweep: an owner lost track of them


class KVImporter:
    """Owns one decode replica's side of every handoff, from handle to running request.

    `import_kv` checks the handle, reserves blocks (waiting, within what is left of
    the lease, for running sequences to free some), pulls, and releases the lease, or
    rejects it on any failure so prefill frees at once. It returns an `ImportedKV`, or
    raises `ImportFailed` (with `recompute_on_failure`, a failed pull or an expired
    lease returns an `ImportedKV` with no blocks instead: decode computes the prompt). A caller cancelled
    mid-import does not cut the pull short (a pull in its thread writes into the
    reserved blocks): the import ends on its own and its blocks are freed then.
    """

    def __init__(
        self,
        backend: KVTransferBackend,
        blocks: ImportBlocks,
        *,
        timeout_s: float,
        lease_ttl_s: float,
        recompute_on_failure: bool,
        recorder: metrics.Recorder | None = None,
    ) -> None:
        self.backend = backend
        self.blocks = blocks
        self.timeout_s = timeout_s
        self.recompute_on_failure = recompute_on_failure
        # Past this an import cannot still be pulling for any lease: TTL + one pull + slack.
        self.stale_after_s = lease_ttl_s + timeout_s + 5.0
        self._recorder = recorder
        self._counts = {"imports": 0, "import_rejects": 0, "import_failures": 0, "import_recomputes": 0}
        self._reclaimed = 0
        self._lock = threading.Lock()
        self._custody: dict[int, ImportedKV] = {}
        # The loop keeps only weak references to tasks: an import nobody awaits any more
        # (its caller left) must not be collected half-way.
        self._running: set[asyncio.Future] = set()

    @property
    def num_waiting(self) -> int:
        return len(self._running)

    async def import_kv(self, handle: KVHandle, parent: Span | TraceCarrier | None = None) -> ImportedKV:
        """The request's prompt KV in this replica's blocks; traced as a `kv_transfer` span."""
        task = asyncio.ensure_future(self._traced(handle, parent))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        try:
            return await asyncio.shield(task)
        except BaseException:  # cancelled, or the import failed (then it holds nothing)
            task.add_done_callback(_discard_result)
            raise

    async def _traced(self, handle: KVHandle, parent: Span | TraceCarrier | None) -> ImportedKV:
        span = tracing.start_span("kv_transfer", parent, SpanKind.CLIENT, {
            "duet.transfer.backend": handle.backend,
            "duet.transfer.blocks": handle.num_blocks,
            "duet.transfer.bytes": handle.num_bytes,
            "duet.transfer.prefill_replica": handle.prefill_replica_id,
            "duet.lease_id": handle.lease_id,
        })
        try:
            imported = await self._import(handle, span)
        except BaseException as e:
            tracing.end_span(span, e)
            raise
        tracing.set_attributes(span, {"duet.transfer.recomputed": True} if imported.recompute
                               else {"duet.transfer.result": "released"})
        tracing.end_span(span)
        return imported

    async def _import(self, handle: KVHandle, span: Span) -> ImportedKV:
        imported: ImportedKV | None = None
        try:
            lease_left = check_handle(self.backend, handle)  # before reserving anything
            blocks = await reserve_when_free(
                lambda: self.blocks.reserve_blocks(handle.num_tokens),
                could_fit=self.blocks.could_ever_hold(handle.num_tokens),
                wait_s=lease_left - self.timeout_s,  # the pull itself must still fit in the lease
            )
            if blocks is None:
                return await self._failed(handle, span, RejectReason.NO_FREE_BLOCKS,
                                          "decode replica has no free KV blocks")
            imported = self._hold(handle.request_id, blocks)
            started = time.monotonic()
            await asyncio.to_thread(pull_kv, self.backend, handle, blocks, timeout_s=self.timeout_s)
            pulled = time.monotonic() - started
            self._count("imports")
            if self._recorder is not None:
                self._recorder.inc(metrics.TRANSFER_BYTES, handle.num_bytes, backend=handle.backend)
                self._recorder.observe(metrics.TRANSFER_SECONDS, pulled, backend=handle.backend)
            tracing.set_attributes(span, {"duet.transfer.pull_ms": round(pulled * 1e3, 3)})
            await asyncio.to_thread(release_lease, handle, self.timeout_s)
            return imported
        except (TransferError, LayoutMismatch) as e:
            if imported is not None:
                imported.discard()
            return await self._failed(handle, span, _reject_reason(e), str(e))
        except BaseException:  # whatever else ends it, the blocks it reserved are freed now
            if imported is not None:
                imported.discard()
            raise

    async def _failed(self, handle: KVHandle, span: Span, reason: RejectReason, detail: str) -> ImportedKV:
        """Reject the lease (prefill frees at once), count, and recompute or raise."""
        if self._recorder is not None:
            self._recorder.inc(metrics.TRANSFER_FAILURES, reason=reason.value)
        tracing.set_attributes(span, {"duet.transfer.result": _result(reason), "duet.transfer.error": detail[:300]})
        self._count("import_rejects" if reason == RejectReason.NO_FREE_BLOCKS else "import_failures")
        await asyncio.to_thread(reject_lease, handle, reason, self.timeout_s)
        if self.recompute_on_failure and reason in _RECOMPUTABLE:
            self._count("import_recomputes")
            log.warning("recomputing %s after failed import: %s", handle.request_id, detail)
            return self._hold(handle.request_id, None)
        raise ImportFailed(reason.value, detail)

    def _hold(self, request_id: str, blocks: list[int] | None) -> ImportedKV:
        imported = ImportedKV(request_id, blocks, self)
        with self._lock:
            self._custody[id(imported)] = imported
        return imported

    def _ended(self, imported: ImportedKV) -> None:
        with self._lock:
            self._custody.pop(id(imported), None)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def sweep(self) -> int:
        """Free blocks held past any lease they could still be pulled for: a safety
        net like the lease TTL on the prefill side, logged and counted, because it
        means an owner lost track of them. Returns the blocks freed."""
        cutoff = time.monotonic() - self.stale_after_s
        with self._lock:
            stale = [c for c in self._custody.values() if c.since < cutoff]
        freed = 0
        for imported in stale:
            n = imported.discard()
            if n:
                log.warning("import of %s held %d KV blocks for over %.0f s: reclaimed",
                            imported.request_id, n, self.stale_after_s)
            freed += n
        with self._lock:
            self._reclaimed += freed
        return freed

    def stats(self) -> ImportStats:
        now = time.monotonic()
        with self._lock:
            held = sorted(self._custody.values(), key=lambda c: c.since)
            counts, reclaimed = dict(self._counts), self._reclaimed
        return ImportStats(
            **counts,
            imports_waiting=self.num_waiting,
            import_blocks_held=sum(c.num_blocks for c in held),
            import_held_oldest=tuple((c.request_id, round(now - c.since, 1)) for c in held[:4]),
            import_blocks_reclaimed=reclaimed,
        )

    def stats_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self.stats())


async def reserve_when_free(
    reserve: Callable[[], Awaitable[list[int] | None]], could_fit: bool, wait_s: float,
    first_delay_s: float = 0.01, max_delay_s: float = 0.2,
) -> list[int] | None:
    """Blocks for an import. A full pool that could hold the prompt frees blocks as
    running sequences finish: wait for them (backing off) for up to `wait_s`, rather
    than fail a request a burst's backlog flushed in at once. One that could never
    hold it (or no time left) is refused at once. None: no blocks."""
    deadline = time.monotonic() + wait_s
    delay = first_delay_s
    while True:
        blocks = await reserve()
        if blocks is not None or not could_fit or time.monotonic() + delay > deadline:
            return blocks
        await asyncio.sleep(delay)
        delay = min(2 * delay, max_delay_s)


# A mismatch is a deployment error: recomputing would hide it (docs/ARCHITECTURE.md).
# Only a prompt's KV lost on the way is recomputed here: a mismatch is a configuration
# error, and a decode replica without free blocks for the KV has none to compute it in
# either (that is a capacity error, which the gateway answers as one).
_RECOMPUTABLE = (RejectReason.TRANSFER_FAILED, RejectReason.LEASE_EXPIRED)


def _discard_result(task: asyncio.Future) -> None:
    """Done-callback of an import whose caller left: free what it still holds."""
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        task.result().discard()
    elif not isinstance(error, ImportFailed):
        log.warning("import failed after its caller left: %r", error)


def _result(reason: RejectReason) -> str:
    """A failed import's result on its trace: the lease was rejected (decode full),
    ran out, or the transfer failed."""
    if reason == RejectReason.NO_FREE_BLOCKS:
        return "rejected"
    if reason == RejectReason.LEASE_EXPIRED:
        return "expired"
    return "failed"


def _reject_reason(exc: Exception) -> RejectReason:
    if isinstance(exc, LayoutMismatch):
        return RejectReason.LAYOUT_MISMATCH
    if isinstance(exc, BackendMismatch):
        return RejectReason.BACKEND_MISMATCH
    if isinstance(exc, PeerMismatch):
        return RejectReason.PEER_MISMATCH
    if isinstance(exc, LeaseExpired):
        return RejectReason.LEASE_EXPIRED
    return RejectReason.TRANSFER_FAILED


class LeaseGuard:
    """`async with LeaseGuard(handle)`: on leaving the block, rejects the lease (so
    prefill frees its blocks now rather than at expiry) unless `settled` says decode
    ended it. The rejection runs in a thread, bounded by `timeout_s`. It is awaited
    when the block ends by itself or by an error (so a migration's next pass starts
    after it), not when the caller is being cancelled or closed: a cancelled task is
    cancelled again at every await (anyio), and its cleanup must finish in one step."""

    def __init__(self, handle: KVHandle, timeout_s: float = 1.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        # Why the lease is rejected if the block is left now: nobody said otherwise,
        # so the caller went away.
        self.reason: RejectReason | None = RejectReason.CLIENT_DISCONNECTED

    def settled(self) -> None:
        """Decode released or rejected the lease itself: nothing to do on exit."""
        self.reason = None

    def reject_as(self, reason: RejectReason) -> None:
        self.reason = reason

    async def __aenter__(self) -> LeaseGuard:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if self.reason is None:
            return
        loop = asyncio.get_running_loop()
        sent = loop.run_in_executor(None, reject_lease, self.handle, self.reason, self.timeout_s)
        if exc_type is not None and issubclass(exc_type, (asyncio.CancelledError, GeneratorExit)):
            return  # sent from its thread; nothing here may wait
        await asyncio.shield(sent)
