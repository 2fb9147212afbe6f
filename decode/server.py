"""The decode pool's Serve deployment.

For each `DecodeRequest`: the replica's `KVImporter` (kvtransfer/handoff.py) checks
the handle, reserves blocks, pulls the KV from the prefill replica (NIXL READ, or the
torch backend) and releases the lease (or rejects it when anything fails); then the
request joins the running batch with those blocks and its tokens stream back. A
failed import fails the request with a clear error, or recomputes the prompt here
when `transfer.on_failure: recompute` (never on a layout or backend mismatch);
either way it is counted.

For a `PrefillRequest` (the router's `disaggregation` rule chose to prefill it here,
autoscaling/placement.py) the replica computes the prompt itself, chunked
within its engine's per-step token budget beside the running batch, and streams the
whole request: no lease, no transfer.

When Serve starts draining the replica (scale-down, rolling update; `DrainWatch`)
and `transfer.move_on_drain` is on, its decoding sequences move instead of finishing
here: each leaves the engine with its KV pinned, the replica's `KVExporter` leases
the blocks the way prefill does, and the stream ends with a `SequenceMoved` whose
`DecodeRequest` another decode replica imports and continues (sampler, detokenizer
and grammar state included). The replica stops once those leases have ended.

A decode engine core child that dies is replaced in place (engine/core_restarts.py):
its streams fail at once and migrate to another replica (the pipeline never sends a
pass back here meanwhile), and a new engine core, backend, importer and exporter
take over in a few seconds; the routers see `serving: false` until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from autoscaling.placement import DecodeSide
from autoscaling.signals import DecodeSignals
from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.core_client import EngineCoreClient, engine_in_child
from engine.core_restarts import WAIT_FOR_RESTART_S, CoreRestarts
from engine.engine import MovedSequence
from engine.hashing import block_hashes
from engine.kv_events import KVEvent
from engine.replica_engine import ReplicaEngine
from engine.request import EngineDead, FinishReason, RequestOutput
from kvtransfer.backends import backend_for
from kvtransfer.backends.base import KVTransferBackend
from kvtransfer.config import TransferConfig
from kvtransfer.drain import DrainWatch
from kvtransfer.events.config import PrefixIndexConfig
from kvtransfer.events.publisher import KVEventPublisher
from kvtransfer.handoff import KVExporter, KVImporter
from kvtransfer.messages import DecodeRequest, PrefillRequest, RoutingStats, SequenceMoved
from kvtransfer.replica import close_in_order, node_ip, replica_id, retire_in_background
from telemetry import tracing
from telemetry.replica import ReplicaTelemetry
from telemetry.tracing import SpanKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DecodeCore:
    """One engine core and what lives and dies with it: the transfer backend its KV
    tensor is registered with, the importer that fills its blocks, and the exporter
    of the sequences it moves out."""

    engine: ReplicaEngine
    backend: KVTransferBackend
    importer: KVImporter
    exporter: KVExporter


class DecodeServer:
    """Owns one decode engine, its KV transfer backend, its importer, and the exporter
    of the sequences it hands on when it drains.

    Constructor arguments are dumped settings: `engine` an `EngineConfig`, `transfer`
    a `TransferConfig`, `prefix_index` a `PrefixIndexConfig` (where its KV events go;
    None: it publishes none), `telemetry` a `TelemetryConfig`; `engine_process` the
    pool's setting of that name.
    """

    def __init__(self, engine: dict, threads: int | None, transfer: dict, prefix_index: dict | None = None,
                 telemetry: dict | None = None, engine_process: bool | None = None):
        self.transfer = TransferConfig.model_validate(transfer)
        self.replica_id = replica_id()
        self._engine_cfg = EngineConfig.model_validate(engine)
        self._threads = threads
        self._kv_events = prefix_index is not None
        self._in_child = engine_in_child(engine_process, self._engine_cfg, "decode")
        self.telemetry = ReplicaTelemetry(telemetry, "decode", self.replica_id, self._metric_stats)
        self._generation = 0
        self.restarts = CoreRestarts(self._restart, f"decode replica {self.replica_id}")
        self.core = self._start_core()
        # What this replica caches (imported prompts, local prefills, generated tokens),
        # published only when prompts may be prefilled here (`router.disaggregation` not
        # `always`): the decode router places them by it and `auto` prices them with it.
        # Every report carries the event log, so it is not sent for nothing.
        self.events = None if prefix_index is None else KVEventPublisher(
            PrefixIndexConfig.model_validate(prefix_index).of_pool("decode"), self._engine_cfg.block_size,
            self.replica_id, self._take_kv_events)
        self.signals = DecodeSignals()
        self._moved: dict[str, MovedSequence] = {}  # leased as it left the engine, until its stream says so
        self._moves_out = 0
        self.drain = DrainWatch(self._on_drain)
        self._moving: asyncio.Future | None = None
        self._closed = False
        log.info("decode replica %s ready (backend %s)", self.replica_id, self.backend.name)

    # ------------------------------------------------------------ the engine core
    def _start_core(self) -> _DecodeCore:
        """A new engine core (in a child process, its KV tensor in shared memory that
        this process maps and registers with the transfer backend, on a CPU), a new
        transfer backend (a new peer), the importer that fills its blocks and the
        exporter of the sequences it hands on when it drains."""
        self._generation += 1
        generation = self._generation
        made: list[Callable[[], None]] = []
        try:
            engine: ReplicaEngine = (
                EngineCoreClient(self._engine_cfg, "decode", self._threads, kv_events=self._kv_events,
                                 on_lost=lambda e: self._lost(generation, e))
                if self._in_child
                else start_engine(self._engine_cfg, "decode", self._threads, kv_events=self._kv_events))
            made.append(engine.shutdown)
            backend = backend_for(self.transfer, self.replica_id, engine.model_id, host=node_ip())
            made.insert(0, backend.close)
            backend.register(engine.kv_data)  # before the engine serves anything
            importer = KVImporter(
                backend, engine, timeout_s=self.transfer.timeout_s, lease_ttl_s=self.transfer.lease_ttl_s,
                recompute_on_failure=self.transfer.on_failure == "recompute", recorder=self.telemetry.metrics,
            )

            def free_blocks(block_ids) -> None:  # a lease on blocks this engine moved out ended
                engine.release_blocks(list(block_ids))

            exporter = KVExporter(backend, self.replica_id, free_blocks, lease_ttl_s=self.transfer.lease_ttl_s,
                                  host=node_ip())
        except BaseException:
            close_in_order(made, "decode (engine core that did not start)")
            raise
        return _DecodeCore(engine, backend, importer, exporter)

    def _lost(self, generation: int, error: BaseException) -> None:
        if generation == self._generation and not self._closed:
            self.restarts.lost(error)

    def _restart(self) -> None:
        """Replace the lost engine core (on the restart thread). What it imported or
        moved out failed with it; its backend closes once its imports have ended and
        the leases of the sequences it moved out (their KV still mapped here) are over."""
        old, self.core = self.core, self._start_core()
        if self.events is not None:
            self.events.engine_replaced(self._take_kv_events)
        retire_in_background(lambda: old.importer.num_waiting == 0 and not len(old.exporter.leases),
                             [old.exporter.close, old.backend.close, old.engine.shutdown], "decode",
                             within_s=self.transfer.lease_ttl_s + self.transfer.timeout_s + 1.0)

    def _take_kv_events(self) -> list[KVEvent]:
        return self.core.engine.take_kv_events()

    @property
    def aengine(self) -> ReplicaEngine:
        return self.core.engine

    @property
    def backend(self) -> KVTransferBackend:
        return self.core.backend

    @property
    def importer(self) -> KVImporter:
        return self.core.importer

    @property
    def exporter(self) -> KVExporter:
        return self.core.exporter

    async def generate(
        self, req: DecodeRequest | PrefillRequest
    ) -> AsyncGenerator[list[RequestOutput] | SequenceMoved, None]:
        """The request's outputs after its first token (a `DecodeRequest`: its KV is
        imported), or all of them (a `PrefillRequest`: prefilled here); a
        `SequenceMoved` last when the replica drained and handed the request on."""
        self._watch_drain()
        if self.lost_replica() is not None:  # sent here all the same: no other replica serves
            await self.restarts.wait_for_engine(lambda: self.lost_replica() is None, WAIT_FOR_RESTART_S)
        span = tracing.start_span("decode", req.trace, SpanKind.SERVER, {
            "duet.request_id": req.request_id,
            "duet.replica": self.replica_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
            "duet.prefilled_here": isinstance(req, PrefillRequest),
            "duet.resumed": isinstance(req, DecodeRequest) and req.resume is not None,
        })
        steps = self._generate_local(req) if isinstance(req, PrefillRequest) else self._generate(req, span)
        try:
            async with contextlib.aclosing(self.telemetry.traced(span, steps)) as batches:
                async for outs in batches:
                    if outs[-1].finish_reason is not FinishReason.MOVED:
                        yield outs
                        continue
                    if outs[:-1]:
                        yield outs[:-1]
                    moved = self._hand_on(req)
                    tracing.set_attributes(span, {"duet.moved": True,
                                                  "duet.lease_id": moved.request.kv_handle.lease_id})
                    yield moved
        finally:
            if self._moved.pop(req.request_id, None) is not None:  # moved, but its caller left first
                self.exporter.withdraw(req.request_id)

    async def _generate(self, req: DecodeRequest, span: tracing.Span) -> AsyncGenerator[list[RequestOutput], None]:
        started = time.monotonic()
        imported = await self.importer.import_kv(req.kv_handle, span)
        tracing.set_attributes(span, {"duet.import_wait_ms": round((time.monotonic() - started) * 1e3, 3)})
        try:
            stream = await self.aengine.add_imported_request(
                req.request_id, list(req.prompt_token_ids), req.first_token, req.sampling, imported.take,
                req.cache_salt, req.resume,
            )
        except BaseException:
            imported.discard()  # the engine never took them (cancelled first, or it refused)
            raise
        async for outs in self._stream(stream, local=False):
            yield outs

    async def _generate_local(self, req: PrefillRequest) -> AsyncGenerator[list[RequestOutput], None]:
        stream = await self.aengine.add_request(req.request_id, list(req.prompt_token_ids), req.sampling,
                                                req.cache_salt, req.fork_of)
        async for outs in self._stream(stream, local=True):
            yield outs

    async def _stream(self, stream: AsyncGenerator[list[RequestOutput], None],
                      local: bool) -> AsyncGenerator[list[RequestOutput], None]:
        """The engine's outputs, closed with us (which aborts the request now). A finished
        request's decoding time feeds the autoscaling signals: from its first step when
        its KV was imported, from its first token when it was prefilled here (its
        uncached prompt tokens then count as prefill work done here)."""
        async with contextlib.aclosing(stream) as outputs:
            async for outs in outputs:
                final = outs[-1]
                moved = final.finish_reason is FinishReason.MOVED  # it decodes on elsewhere
                if final.finished and not moved and (m := final.metrics) is not None:
                    decoding_from = m.first_token_time if local else m.first_scheduled_time
                    self.signals.request(decoding_from, m.finished_time, final.num_output_tokens)
                    if local and m.first_token_time is not None:
                        self.signals.prefilled_here(final.num_prompt_tokens - final.num_cached_tokens,
                                                    m.first_token_time)
                yield outs

    # ------------------------------------------------------------ moving on drain
    def _watch_drain(self) -> None:
        if self.transfer.move_on_drain and not self._closed:
            self.drain.start()  # needs the running loop: started by the first call

    def _on_drain(self) -> None:
        """Serve stopped routing here: hand every decoding sequence on (those still
        prefilling here finish here)."""
        self._moving = asyncio.ensure_future(self._move_all())  # held: the loop keeps only weak references

    async def _move_all(self) -> None:
        ids = list(self.aengine.stats.request_ids)
        try:
            moved = await self.aengine.move_out(ids, self._lease_moved)
        except Exception:
            log.exception("moving the running sequences of a draining replica failed")
            return
        log.warning("draining: moved %d of %d sequences", len(moved), len(ids))

    def _lease_moved(self, seq: MovedSequence) -> None:
        """As the sequence leaves the engine (on the engine thread, or the engine core
        client's reader before its stream ends): lease its blocks."""
        self.exporter.grant(seq.request_id, seq.block_ids)
        self._moved[seq.request_id] = seq

    def _hand_on(self, req: DecodeRequest | PrefillRequest) -> SequenceMoved:
        """The request that continues a sequence this replica moved out, its KV leased here."""
        seq = self._moved.pop(req.request_id, None)
        if seq is None:  # its lease could not be granted (logged where it failed)
            raise RuntimeError(f"{req.request_id} left the engine to move, but holds no lease")
        self._moves_out += 1
        handle = self.exporter.handle_for(req.request_id, seq.num_computed_tokens)
        call = DecodeRequest(req.request_id, tuple(seq.token_ids[:-1]), seq.token_ids[-1], req.sampling, handle,
                             req.trace, req.cache_salt, resume=seq.resume)
        return SequenceMoved(call, self.replica_id)

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by Serve every `router.stats_period_s` for the decode router."""
        return RoutingStats.of_engine(
            self.aengine.stats, model_fingerprint=self.aengine.model_fingerprint,
            kv_log=self.events.window() if self.events is not None else None, serving=self.restarts.serving,
        ).to_wire()

    def lost_replica(self) -> str | None:
        """This replica's id while its engine is lost (the pipeline sends passes
        elsewhere), else None."""
        try:
            self.aengine.check_health()
        except EngineDead:
            return self.replica_id
        return None

    async def local_view(self, req: PrefillRequest) -> DecodeSide:
        """This replica as the local side of `router.disaggregation: auto`'s price, read
        from its own KV events (none published: no prefix)."""
        stats = self.aengine.stats
        need = -(-len(req.prompt_token_ids) // self.aengine.block_size) + 1
        held = 0
        if self.events is not None:
            hashes = block_hashes(req.prompt_token_ids, self.aengine.block_size, self.aengine.model_fingerprint,
                                  req.cache_salt)
            held = self.events.leading_cached(hashes) * self.aengine.block_size
        return DecodeSide(held, stats.num_requests, stats.kv_blocks_free >= need)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by Serve every `metrics_interval_s` for the autoscaling policy."""
        return self.signals.report(self.aengine.stats, waiting_imports=self.importer.num_waiting)

    def _metric_stats(self) -> dict[str, Any]:
        return {**self.aengine.stats.as_dict(), **self.restarts.stats()}

    async def stats(self) -> dict[str, Any]:
        m = self.backend.metrics.snapshot()  # the backend counts every pull, failures too
        return {
            **self.aengine.stats.as_dict(),
            "replica_id": self.replica_id,
            "node_ip": node_ip(),
            "transfer_count": m.transfers,
            "transfer_failures": m.failures,
            "transfer_bytes": m.bytes,
            "transfer_seconds": m.seconds,
            "transfer_blocks": m.blocks,
            **self.importer.stats_dict(),
            **self.exporter.stats(),
            **(self.events.stats() if self.events is not None else {}),
            "moves_out": self._moves_out,
            "draining": self.drain.draining,
            **self.restarts.stats(),
        }

    async def check_health(self) -> None:
        """Fails only when the engine is gone for good: an engine core child that died
        is being replaced (`restarts`); an engine thread that died is not."""
        self._watch_drain()
        self.importer.sweep()  # Serve calls this every few seconds
        self.restarts.check_health()
        if not self._in_child:
            self.aengine.check_health()

    def shutdown(self) -> None:
        """Serve calls this (through `__del__`) once the replica's calls have ended. The
        leases of the sequences it moved out outlive those calls: wait until each is
        released, rejected or expired (at most one lease TTL) before the blocks a
        decode replica may be reading disappear; then stop transfers and the engine."""
        if self._closed:
            return
        self._closed = True
        self.restarts.close()
        self.drain.stop()
        left = self.exporter.drain(self.exporter.lease_ttl_s + 1.0)
        if left:
            log.warning("decode replica stopping with %d leases still active", left)
        core = self.core
        steps = [self.telemetry.close, core.exporter.close, core.backend.close, core.engine.shutdown]
        if self.events is not None:
            steps.append(self.events.close)
        close_in_order(steps, "decode")

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
