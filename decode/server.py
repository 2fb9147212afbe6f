"""The decode pool's Serve deployment.

For each `DecodeRequest`: check the handle (backend, layout fingerprint, lease time
left), reserve blocks, pull the KV from the prefill replica (NIXL READ, or the torch
backend), `Release` the lease (or `Reject` it when anything fails), then join the
running batch and stream tokens. Every check and message is kvtransfer/handoff.py's.
A failed import fails the request with a clear error, or recomputes the prompt here
when `transfer.on_failure: recompute` (never on a layout or backend mismatch);
either way it is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from autoscaling.signals import DecodeSignals
from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.request import RequestOutput
from kvtransfer.backends import backend_for
from kvtransfer.backends.base import TransferError
from kvtransfer.config import TransferConfig
from kvtransfer.handoff import BackendMismatch, LeaseExpired, PeerMismatch, check_handle, pull_kv, reject_lease
from kvtransfer.handoff import release_lease
from kvtransfer.layout import LayoutMismatch
from kvtransfer.messages import DecodeRequest, ImportFailed, RejectReason
from kvtransfer.replica import node_ip, replica_id
from telemetry import metrics, tracing
from telemetry.replica import ReplicaTelemetry
from telemetry.tracing import Span, SpanKind

log = logging.getLogger(__name__)

# A mismatch is a deployment error: recomputing would hide it (docs/ARCHITECTURE.md).
_NEVER_RECOMPUTE = (RejectReason.LAYOUT_MISMATCH, RejectReason.BACKEND_MISMATCH, RejectReason.PEER_MISMATCH)


@dataclass
class ImportCounters:
    imported: int = 0
    rejected: int = 0
    failed: int = 0
    recomputed: int = 0


class HeldBlocks:
    """Blocks reserved for imports that neither the engine nor the pool owns yet, by
    request. Whoever ends an import takes them (`take`): the engine when the request
    starts, or the path that frees them; so however an import ends (failed, cancelled,
    or finished for a client that left), exactly one owner frees its blocks. Used from
    the event loop and the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[str, tuple[list[int], float]] = {}  # request id -> (blocks, since)

    def hold(self, request_id: str, blocks: list[int]) -> None:
        with self._lock:
            self._blocks[request_id] = (blocks, time.monotonic())

    def take(self, request_id: str) -> list[int] | None:
        with self._lock:
            held = self._blocks.pop(request_id, None)
        return held[0] if held is not None else None

    def take_older_than(self, age_s: float) -> dict[str, list[int]]:
        """Take every entry held for more than `age_s`."""
        cutoff = time.monotonic() - age_s
        with self._lock:
            old = [rid for rid, (_, since) in self._blocks.items() if since < cutoff]
            return {rid: self._blocks.pop(rid)[0] for rid in old}

    def stats(self) -> dict:
        """How many blocks are held, and the requests holding them for longest (an
        import normally holds its blocks for one pull: seconds at most)."""
        now = time.monotonic()
        with self._lock:
            items = sorted(self._blocks.items(), key=lambda kv: kv[1][1])
        return {
            "import_blocks_held": sum(len(b) for _, (b, _) in items),
            "import_held_oldest": [(rid, round(now - t, 1)) for rid, (_, t) in items[:4]],
        }


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


def _result(reason: str) -> str:
    """A failed import's result on its trace: the lease was rejected (decode full),
    ran out, or the transfer failed."""
    if reason == RejectReason.NO_FREE_BLOCKS:
        return "rejected"
    if reason == RejectReason.LEASE_EXPIRED:
        return "expired"
    return "failed"


def _reason(exc: Exception) -> RejectReason:
    if isinstance(exc, LayoutMismatch):
        return RejectReason.LAYOUT_MISMATCH
    if isinstance(exc, BackendMismatch):
        return RejectReason.BACKEND_MISMATCH
    if isinstance(exc, PeerMismatch):
        return RejectReason.PEER_MISMATCH
    if isinstance(exc, LeaseExpired):
        return RejectReason.LEASE_EXPIRED
    return RejectReason.TRANSFER_FAILED


class DecodeServer:
    """Owns one decode engine and its KV transfer backend.

    Constructor arguments are dumped settings: `engine` an `EngineConfig`, `transfer`
    a `TransferConfig`, `telemetry` a `TelemetryConfig`.
    """

    def __init__(self, engine: dict, threads: int, transfer: dict, telemetry: dict | None = None):
        self.transfer = TransferConfig.model_validate(transfer)
        self.replica_id = replica_id()
        self.aengine = start_engine(EngineConfig.model_validate(engine), "decode", threads)
        eng = self.aengine.engine
        self.backend = backend_for(self.transfer, self.replica_id, eng.model_id, host=node_ip())
        self.backend.register(eng.kv_cache.data)
        self.counters = ImportCounters()
        self.held = HeldBlocks()
        # The loop keeps only weak references to tasks: an import nobody awaits any
        # more (its caller left) must not be collected half-way.
        self._imports: dict[str, asyncio.Task] = {}
        self.reclaimed_blocks = 0
        self.telemetry = ReplicaTelemetry(telemetry, "decode", self.replica_id, lambda: self.aengine.stats)
        self.signals = DecodeSignals()
        log.info("decode replica %s ready (backend %s)", self.replica_id, self.backend.name)

    async def _import(self, req: DecodeRequest, parent: Span) -> list[int] | None:
        """Blocks holding the prompt's KV, or None to recompute. Raises ImportFailed.
        Traced as one `kv_transfer` span under `parent`, with its result."""
        h = req.kv_handle
        span = tracing.start_span("kv_transfer", parent, SpanKind.CLIENT, {
            "duet.transfer.backend": h.backend,
            "duet.transfer.blocks": h.num_blocks,
            "duet.transfer.bytes": h.num_bytes,
            "duet.transfer.prefill_replica": h.prefill_replica_id,
            "duet.lease_id": h.lease_id,
        })
        try:
            blocks = await self._pull(req, span)
        except BaseException as e:
            if isinstance(e, ImportFailed):
                tracing.set_attributes(span, {"duet.transfer.result": _result(e.reason)})
            tracing.end_span(span, e)
            raise
        if blocks is not None:
            tracing.set_attributes(span, {"duet.transfer.result": "released"})
        else:  # the import failed (its result is set) and the prompt is recomputed here
            tracing.set_attributes(span, {"duet.transfer.recomputed": True})
        tracing.end_span(span)
        return blocks

    async def _pull(self, req: DecodeRequest, span: Span) -> list[int] | None:
        h = req.kv_handle
        eng = self.aengine.engine
        timeout = self.transfer.timeout_s
        blocks = None
        try:
            lease_left = check_handle(self.backend, h)  # before reserving anything
            blocks = await reserve_when_free(
                lambda: self.aengine.call(lambda: eng.reserve_import(h.num_tokens)),
                could_fit=eng.kv_manager.blocks_needed(h.num_tokens) <= eng.block_pool.num_blocks,
                wait_s=lease_left - timeout,  # the pull itself must still fit in the lease
            )
            if blocks is None:
                reason, detail = RejectReason.NO_FREE_BLOCKS, "decode replica has no free KV blocks"
            else:
                self.held.hold(req.request_id, blocks)
                started = time.monotonic()
                await asyncio.to_thread(pull_kv, self.backend, h, blocks, timeout_s=timeout)
                pulled = time.monotonic() - started
                self.counters.imported += 1
                self.telemetry.metrics.inc(metrics.TRANSFER_BYTES, h.num_bytes, backend=h.backend)
                self.telemetry.metrics.observe(metrics.TRANSFER_SECONDS, pulled, backend=h.backend)
                tracing.set_attributes(span, {"duet.transfer.pull_ms": round(pulled * 1e3, 3)})
                await asyncio.to_thread(release_lease, h, timeout)
                return blocks
        except (TransferError, LayoutMismatch) as e:
            reason, detail = _reason(e), str(e)
            await self._free_held(req.request_id)
        # Every failure path frees the prefill side at once.
        self.telemetry.metrics.inc(metrics.TRANSFER_FAILURES, reason=reason.value)
        tracing.set_attributes(span, {"duet.transfer.result": _result(reason), "duet.transfer.error": detail[:300]})
        if reason == RejectReason.NO_FREE_BLOCKS:
            self.counters.rejected += 1
        else:
            self.counters.failed += 1
        await asyncio.to_thread(reject_lease, h, reason, timeout)
        if self.transfer.on_failure == "recompute" and reason not in _NEVER_RECOMPUTE:
            self.counters.recomputed += 1
            log.warning("recomputing %s after failed import: %s", req.request_id, detail)
            return None
        raise ImportFailed(reason.value, detail)

    async def generate(self, req: DecodeRequest) -> AsyncIterator[list[RequestOutput]]:
        span = tracing.start_span("decode", req.trace, SpanKind.SERVER, {
            "duet.request_id": req.request_id,
            "duet.replica": self.replica_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
        })
        async with contextlib.aclosing(self.telemetry.traced(span, self._generate(req, span))) as batches:
            async for outs in batches:
                yield outs

    async def _generate(self, req: DecodeRequest, span: Span) -> AsyncIterator[list[RequestOutput]]:
        eng = self.aengine.engine
        # A cancelled call (the client left) must not cut an import short: a pull still
        # running in its thread writes into the reserved blocks. The import finishes on
        # its own and its blocks are freed then.
        started = time.monotonic()
        importing = asyncio.ensure_future(self._import(req, span))
        self._imports[req.request_id] = importing
        importing.add_done_callback(lambda _: self._imports.pop(req.request_id, None))
        try:
            await asyncio.shield(importing)  # its blocks (None: recompute) wait in self.held
        except BaseException:  # cancelled, the generator closed, or the import failed
            importing.add_done_callback(self._discard_import(req.request_id))
            raise
        tracing.set_attributes(span, {"duet.import_wait_ms": round((time.monotonic() - started) * 1e3, 3)})

        def start():
            held = self.held.take(req.request_id)
            try:
                eng.add_imported_request(
                    req.request_id, list(req.prompt_token_ids), req.first_token, req.sampling, held
                )
            except Exception:
                if held is not None:
                    eng.release_blocks(held)
                raise

        try:
            stream = await self.aengine.add(req.request_id, start)
        except BaseException:
            # Cancelled before the engine ran `start` (it skips a cancelled command): the
            # blocks are still held here, and nobody else will take them.
            self._free_held_soon(req.request_id)
            raise
        async with contextlib.aclosing(stream) as outputs:  # closed with us: aborts the request now
            async for outs in outputs:
                if outs[-1].finished and (m := outs[-1].metrics) is not None:
                    self.signals.request(m.first_scheduled_time, m.finished_time, outs[-1].num_output_tokens)
                yield outs

    def _discard_import(self, request_id: str) -> Callable[[asyncio.Future], None]:
        """A done-callback for an import nobody will decode: frees the blocks it still
        holds, whether it succeeded, failed or was cancelled (its lease is ended)."""
        def discard(importing: asyncio.Future) -> None:
            if not importing.cancelled() and importing.exception() is not None \
                    and not isinstance(importing.exception(), ImportFailed):
                log.warning("import of %s failed: %r", request_id, importing.exception())
            self._free_held_soon(request_id)
        return discard

    def _free_held_soon(self, request_id: str) -> None:
        blocks = self.held.take(request_id)
        if blocks is not None:
            eng = self.aengine.engine
            self.aengine.submit(lambda: eng.release_blocks(blocks))

    async def _free_held(self, request_id: str) -> None:
        blocks = self.held.take(request_id)
        if blocks is not None:
            eng = self.aengine.engine
            await self.aengine.call(lambda: eng.release_blocks(blocks))

    def record_routing_stats(self) -> dict:
        """Read by Serve every `router.stats_period_s` for the decode router."""
        s = self.aengine.stats
        return {
            "num_running": s["num_running"] + s["num_waiting"],
            "kv_blocks_free": s["kv_blocks_free"],
            "kv_blocks_total": s["kv_blocks_total"],
            "request_ids": s["request_ids"],
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by Serve every `metrics_interval_s` for the autoscaling policy."""
        return self.signals.report(self.aengine.stats, waiting_imports=len(self._imports))

    async def stats(self) -> dict:
        m = self.backend.metrics.snapshot()  # the backend counts every pull, failures too
        return {
            **self.aengine.stats,
            "replica_id": self.replica_id,
            "node_ip": node_ip(),
            "transfer_count": m.transfers,
            "transfer_failures": m.failures,
            "transfer_bytes": m.bytes,
            "transfer_seconds": m.seconds,
            "transfer_blocks": m.blocks,
            "imports": self.counters.imported,
            "import_rejects": self.counters.rejected,
            "import_failures": self.counters.failed,
            "import_recomputes": self.counters.recomputed,
            **self.held.stats(),
            "import_blocks_reclaimed": self.reclaimed_blocks,
        }

    def _reclaim_stale_imports(self) -> None:
        """Free blocks an import has held past any lease it could still be pulling
        for (TTL + one pull): a safety net like the lease TTL on the prefill side,
        logged and counted because it means an import path lost track of them."""
        bound = self.transfer.lease_ttl_s + self.transfer.timeout_s + 5.0
        stale = self.held.take_older_than(bound)
        if not stale:
            return
        eng = self.aengine.engine
        for request_id, blocks in stale.items():
            task = self._imports.get(request_id)
            where = task.get_stack(limit=8) if task is not None else "no import task"
            log.warning("import of %s held %d KV blocks for over %.0f s: reclaimed (%r; %s)",
                        request_id, len(blocks), bound, task, where)
            self.aengine.submit(lambda b=blocks: eng.release_blocks(b))
            self.reclaimed_blocks += len(blocks)

    async def check_health(self) -> None:
        self._reclaim_stale_imports()  # Serve calls this every few seconds
        self.aengine.check_health()
