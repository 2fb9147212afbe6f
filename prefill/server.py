"""The prefill pool's Serve deployment.

An `Engine` in prefill role computes each prompt (own prefix cache first, then the
LMCache tiers when `cache:` turns them on), samples the first token and leaves the
request's blocks pinned. The replica's `KVExporter` (kvtransfer/handoff.py) leases
them the moment the request finishes (before its last output is delivered), and
`prefill` returns `PrefillResult(first_token, kv_handle)`. The lease ends exactly once: decode's
`Release` (blocks stay as prefix cache), decode's `Reject` (freed at once), or expiry.
The replica publishes its block pool's KV events for the routers
(kvtransfer/events/publisher.py).

On a CPU the engine runs in a child process (`prefill.engine_process`,
engine/core_process.py): its KV tensor is shared memory that this process registers
with the transfer backend, and each step's exports reach `lease` before that step's
outputs. A child that dies is replaced in place (engine/core_restarts.py): a new
engine core with a new backend and exporter, while the old ones serve the leases
already out until they end. The LMCache tier is built, used and closed wherever the
engine runs (its connector works inside the engine's step): the replica names it
(`KVTierConfig.external_kv_spec`) and reads its counters with the engine's stats.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from autoscaling.signals import PrefillSignals
from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.core_client import EngineCoreClient, engine_in_child
from engine.core_restarts import CoreRestarts
from engine.engine import ExportedKV
from engine.kv_events import KVEvent
from engine.replica_engine import ReplicaEngine
from engine.request import FinishReason
from kvtransfer.backends import backend_for
from kvtransfer.backends.base import KVTransferBackend
from kvtransfer.config import TransferConfig
from kvtransfer.events.config import PrefixIndexConfig
from kvtransfer.events.publisher import KVEventPublisher
from kvtransfer.handoff import KVExporter
from kvtransfer.messages import PrefillRequest, PrefillResult, RoutingStats
from kvtransfer.replica import close_in_order, node_ip, replica_id, retire_in_background
from prefill.kv_tier.config import KVTierConfig
from telemetry import tracing
from telemetry.replica import ReplicaTelemetry
from telemetry.tracing import SpanKind

log = logging.getLogger(__name__)


class _PrefillCore:
    """One engine core and what lives and dies with it: the transfer backend its KV
    tensor is registered with, and the exporter of that KV's leases."""

    engine: ReplicaEngine
    backend: KVTransferBackend
    exporter: KVExporter

    def lease(self, export: ExportedKV) -> None:
        """As a request finishes (on the engine thread, or the engine core client's
        reader before the request's last output is delivered): pin its blocks under a
        lease."""
        self.exporter.grant(export.request_id, export.block_ids)

    def free_blocks(self, block_ids) -> None:
        self.engine.release_blocks(list(block_ids))


class PrefillServer:
    """Owns one prefill engine (with its KV tier), its handoff exporter and its event publisher.

    Constructor arguments are dumped settings (plain dicts, as Serve configs carry
    them): `engine` an `EngineConfig`, `transfer` a `TransferConfig`, `cache` a
    `KVTierConfig`, `prefix_index` a `PrefixIndexConfig`, `telemetry` a `TelemetryConfig`;
    `engine_process` the pool's setting of that name.
    """

    def __init__(
        self, engine: dict, threads: int | None, transfer: dict, cache: dict, prefix_index: dict,
        telemetry: dict | None = None, engine_process: bool | None = None,
    ):
        self._engine_cfg = EngineConfig.model_validate(engine)
        self._threads = threads
        self._transfer = TransferConfig.model_validate(transfer)
        tier_cfg = KVTierConfig.model_validate(cache)
        self._tier = tier_cfg.external_kv_spec() if tier_cfg.enabled else None
        self._in_child = engine_in_child(engine_process, self._engine_cfg, "prefill")
        self.replica_id = replica_id()
        self._generation = 0
        self.restarts = CoreRestarts(self._restart, f"prefill replica {self.replica_id}")
        self.core = self._start_core()
        self.events = KVEventPublisher(
            PrefixIndexConfig.model_validate(prefix_index), self._engine_cfg.block_size, self.replica_id,
            self._take_kv_events,
        )
        self.telemetry = ReplicaTelemetry(telemetry, "prefill", self.replica_id, self._engine_stats)
        self.signals = PrefillSignals()
        self._closed = False
        log.info("prefill replica %s ready (backend %s)", self.replica_id, self.core.backend.name)

    # ------------------------------------------------------------ the engine core
    def _start_core(self) -> _PrefillCore:
        """A new engine core, its KV tensor registered with a new transfer backend (a
        new peer: handles of an older core name the old one), and the exporter of its
        leases, whose control port goes into the handles."""
        self._generation += 1
        generation = self._generation
        core = _PrefillCore()
        made: list[Callable[[], None]] = []
        try:
            if self._in_child:
                core.engine = EngineCoreClient(
                    self._engine_cfg, "prefill", self._threads, kv_events=True, on_export=core.lease,
                    external_kv=self._tier, on_lost=lambda e: self._lost(generation, e))
            else:
                on_thread = start_engine(self._engine_cfg, "prefill", self._threads, kv_events=True,
                                         external_kv=self._tier)
                on_thread.engine.on_export = core.lease
                core.engine = on_thread
            made.append(core.engine.shutdown)
            core.backend = backend_for(self._transfer, self.replica_id, core.engine.model_id, host=node_ip())
            made.insert(0, core.backend.close)
            core.backend.register(core.engine.kv_data)
            # Before any request: `lease` (called as one finishes) needs it.
            core.exporter = KVExporter(core.backend, self.replica_id, core.free_blocks,
                                       lease_ttl_s=self._transfer.lease_ttl_s, host=node_ip())
        except BaseException:
            close_in_order(made, "prefill (engine core that did not start)")
            raise
        return core

    def _lost(self, generation: int, error: BaseException) -> None:
        if generation == self._generation and not self._closed:
            self.restarts.lost(error)

    def _restart(self) -> None:
        """Replace the lost engine core (on the restart thread). Its leases stay good
        until they end: their KV is still mapped here, and the old backend serves it."""
        old, self.core = self.core, self._start_core()
        self.events.engine_replaced(self._take_kv_events)
        retire_in_background(lambda: not len(old.exporter.leases),
                             [old.exporter.close, old.backend.close, old.engine.shutdown],
                             "prefill", within_s=old.exporter.lease_ttl_s + 1.0)

    def _take_kv_events(self) -> list[KVEvent]:
        return self.core.engine.take_kv_events()

    @property
    def aengine(self) -> ReplicaEngine:
        return self.core.engine

    @property
    def exporter(self) -> KVExporter:
        return self.core.exporter

    def _engine_stats(self) -> dict[str, Any]:
        return {**self.aengine.stats.as_dict(), **self.exporter.stats(), **self.aengine.external_kv_stats,
                **self.restarts.stats()}

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by Serve every `router.stats_period_s` and handed to every router."""
        return RoutingStats.of_engine(
            self.aengine.stats, model_fingerprint=self.aengine.model_fingerprint, kv_log=self.events.window(),
            serving=self.restarts.serving,
        ).to_wire()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Read by Serve every `metrics_interval_s` for the autoscaling policy
        (autoscaling/signals.py names what is in it)."""
        return self.signals.report(self.aengine.stats)

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """The prompt computed, its first token sampled and its KV leased for a decode
        replica (`req.session_id` was the router's hint; `req.trace` is continued)."""
        request_id = req.request_id
        span = tracing.start_span(
            "prefill", req.trace, SpanKind.SERVER,
            {"duet.request_id": request_id, "duet.replica": self.replica_id,
             "gen_ai.usage.input_tokens": req.num_prompt_tokens},
        )
        try:
            result = await self._prefill(req, span)
        except asyncio.CancelledError:
            # The engine may have finished and leased the blocks just before the cancel
            # landed (the abort that ran on the way out then finds nothing to abort):
            # nobody will receive that lease's handle, so end it now, not at its TTL.
            withdrawn = self.exporter.withdraw(request_id)
            tracing.set_attributes(span, {"duet.cancelled": True, "duet.lease_withdrawn": withdrawn})
            tracing.end_span(span)
            raise
        except BaseException as e:
            tracing.end_span(span, e)
            raise
        tracing.set_attributes(span, {
            "gen_ai.usage.cache_read.input_tokens": result.num_cached_tokens,
            "duet.lease_id": result.kv_handle.lease_id if result.kv_handle else None,
            "duet.kv_blocks": result.kv_handle.num_blocks if result.kv_handle else 0,
        })
        tracing.end_span(span)
        return result

    async def _prefill(self, req: PrefillRequest, span: tracing.Span) -> PrefillResult:
        request_id = req.request_id
        stream = await self.aengine.add_request(request_id, list(req.prompt_token_ids), req.sampling, req.cache_salt)
        final = None
        async for outs in stream:
            final = outs[-1]
        assert final is not None and final.finished
        self.telemetry.engine_request(span, final.metrics)
        if (m := final.metrics) is not None:
            self.signals.request(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                                 final.num_prompt_tokens, final.num_cached_tokens)
        if final.finish_reason == FinishReason.ABORT:
            raise asyncio.CancelledError(f"{request_id} aborted")
        handle = None
        reason: FinishReason | None = final.finish_reason
        if reason == FinishReason.PREFILL_DONE:
            handle = self.exporter.handle_for(request_id, final.num_prompt_tokens)
            reason = None
        return PrefillResult(
            request_id=request_id,
            first_token=final.new_token_ids[0] if final.new_token_ids else None,  # None: a grammar's dead end
            kv_handle=handle,
            num_cached_tokens=final.num_cached_tokens,
            num_prompt_tokens=final.num_prompt_tokens,
            first_token_logprobs=final.logprobs[0] if final.logprobs else None,
            text=final.text,
            finish_reason=reason,
        )

    async def stats(self) -> dict[str, Any]:
        return {
            **self.aengine.stats.as_dict(),
            "replica_id": self.replica_id,
            "node_ip": node_ip(),
            **self.exporter.stats(),
            **self.events.stats(),
            **self.aengine.external_kv_stats,
            **self.restarts.stats(),
        }

    async def check_health(self) -> None:
        """Fails only when the engine is gone for good: an engine core child that died
        is being replaced (`restarts`); an engine thread that died is not."""
        self.restarts.check_health()
        if not self._in_child:
            self.aengine.check_health()

    def shutdown(self) -> None:
        """Drain, then stop the control port, transfers and engine (the engine's
        runner closes the tier last, bounded: see KVTier.close).

        Serve calls this (through `__del__`) after it has stopped routing to the replica
        and its calls have ended; the leases it granted outlive those calls, so it
        waits for each to be released, rejected or expired (at most one lease TTL)
        before the blocks a decode replica may be reading disappear."""
        if self._closed:
            return
        self.restarts.close()
        left = self.exporter.drain(self.exporter.lease_ttl_s + 1.0)
        if left:
            log.warning("prefill replica stopping with %d leases still active", left)
        self._closed = True
        core = self.core
        steps = (self.telemetry.close, core.exporter.close, core.backend.close, core.engine.shutdown,
                 self.events.close)
        close_in_order(steps, "prefill")

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
