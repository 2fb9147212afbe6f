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
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.request import RequestOutput
from kvtransfer.backends import make_backend
from kvtransfer.backends.base import TransferError
from kvtransfer.config import TransferConfig
from kvtransfer.handoff import BackendMismatch, LeaseExpired, PeerMismatch, check_handle, pull_kv, reject_lease
from kvtransfer.handoff import release_lease
from kvtransfer.layout import LayoutMismatch
from kvtransfer.messages import DecodeRequest, ImportFailed, RejectReason
from kvtransfer.replica import replica_id
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
        self.backend = make_backend(self.transfer.backend, self.replica_id, eng.model_id)
        self.backend.register(eng.kv_cache.data)
        self.counters = ImportCounters()
        self.telemetry = ReplicaTelemetry(telemetry, "decode", self.replica_id, lambda: self.aengine.stats)
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
            check_handle(self.backend, h)  # before reserving anything
            blocks = await self.aengine.call(lambda: eng.reserve_import(h.num_tokens))
            if blocks is None:
                reason, detail = RejectReason.NO_FREE_BLOCKS, "decode replica has no free KV blocks"
            else:
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
            if blocks is not None:
                ids = blocks
                await self.aengine.call(lambda: eng.release_blocks(ids))
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
        try:
            blocks = await asyncio.shield(importing)
        except BaseException:  # cancelled, or the generator closed; a failed import cleans up itself
            importing.add_done_callback(self._discard_import)
            raise
        tracing.set_attributes(span, {"duet.import_wait_ms": round((time.monotonic() - started) * 1e3, 3)})

        def start():
            try:
                eng.add_imported_request(
                    req.request_id, list(req.prompt_token_ids), req.first_token, req.sampling, blocks
                )
            except Exception:
                if blocks is not None:
                    eng.release_blocks(blocks)
                raise

        stream = await self.aengine.add(req.request_id, start)
        async with contextlib.aclosing(stream) as outputs:  # closed with us: aborts the request now
            async for outs in outputs:
                yield outs

    def _discard_import(self, importing: asyncio.Future) -> None:
        """Free the blocks of an import nobody will decode (its lease is already ended)."""
        if importing.cancelled() or importing.exception() is not None:
            return  # a failed import freed its blocks and rejected its lease itself
        blocks = importing.result()
        if blocks is not None:
            eng = self.aengine.engine
            self.aengine.submit(lambda: eng.release_blocks(blocks))

    def record_routing_stats(self) -> dict:
        """Read by Serve every `router.stats_period_s` for the decode router."""
        s = self.aengine.stats
        return {
            "num_running": s["num_running"] + s["num_waiting"],
            "kv_blocks_free": s["kv_blocks_free"],
            "kv_blocks_total": s["kv_blocks_total"],
            "request_ids": s["request_ids"],
        }

    async def stats(self) -> dict:
        m = self.backend.metrics.snapshot()  # the backend counts every pull, failures too
        return {
            **self.aengine.stats,
            "replica_id": self.replica_id,
            "transfer_count": m.transfers,
            "transfer_failures": m.failures,
            "transfer_bytes": m.bytes,
            "transfer_seconds": m.seconds,
            "transfer_blocks": m.blocks,
            "imports": self.counters.imported,
            "import_rejects": self.counters.rejected,
            "import_failures": self.counters.failed,
            "import_recomputes": self.counters.recomputed,
        }

    async def check_health(self) -> None:
        self.aengine.check_health()
