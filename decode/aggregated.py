"""The aggregated pool: one engine runs both phases with chunked prefill, with the
gateway inside each replica as in P/D mode; the same-hardware baseline for every
disaggregated figure.

It lives beside the decode pool because, like it, it streams tokens to the gateway;
unlike it, it prefills every prompt itself (that is its job, not a fallback). With
the KV-aware router (`router.policy: kv_aware`) it publishes its block pool's KV
events and load, and the aggregated router places each prompt where its prefix is
cached without piling a burst on one replica (routing/router/serve_routers.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.core_restarts import WAIT_FOR_RESTART_S, CoreRestarts
from engine.replica_engine import ReplicaEngine
from engine.request import EngineDead, RequestOutput
from kvtransfer.events.config import PrefixIndexConfig
from kvtransfer.events.publisher import KVEventPublisher
from kvtransfer.messages import PrefillRequest, RoutingStats
from kvtransfer.replica import close_in_order, replica_id
from telemetry import tracing
from telemetry.replica import ReplicaTelemetry
from telemetry.tracing import SpanKind


class AggregatedServer:
    """Owns one aggregated-role engine and, when routing is KV-aware, its event publisher.
    `engine` is a dumped `EngineConfig`, `telemetry` a `TelemetryConfig`, `prefix_index`
    a `PrefixIndexConfig` (where its KV events go; None: it publishes none), and
    `engine_process` the pool's setting of that name."""

    def __init__(self, engine: dict, threads: int | None, telemetry: dict | None = None,
                 prefix_index: dict | None = None, engine_process: bool = False):
        self.replica_id = replica_id()
        self._engine_cfg = EngineConfig.model_validate(engine)
        self._threads = threads
        self._kv_events = prefix_index is not None
        self._in_child = engine_process
        self._generation = 0
        self.restarts = CoreRestarts(self._restart, f"aggregated replica {self.replica_id}")
        self.aengine = self._start_engine()
        self.events = None if prefix_index is None else KVEventPublisher(
            PrefixIndexConfig.model_validate(prefix_index).of_pool("aggregated"), self._engine_cfg.block_size,
            self.replica_id, lambda: self.aengine.take_kv_events())
        self.telemetry = ReplicaTelemetry(telemetry, "aggregated", self.replica_id,
                                         lambda: {**self.aengine.stats.as_dict(), **self.restarts.stats()})
        self._closed = False

    def _start_engine(self) -> ReplicaEngine:
        """`engine_process`: the engine core in a child process (no GIL shared with
        this replica's event loop), replaced in place if it dies
        (engine/core_restarts.py); otherwise on a thread of this process."""
        self._generation += 1
        generation = self._generation
        if self._in_child:
            return EngineCoreClient(self._engine_cfg, "aggregated", self._threads, kv_events=self._kv_events,
                                    on_lost=lambda e: self._lost(generation, e))
        return start_engine(self._engine_cfg, "aggregated", self._threads, kv_events=self._kv_events)

    def _lost(self, generation: int, error: BaseException) -> None:
        if generation == self._generation and not self._closed:
            self.restarts.lost(error)

    def _restart(self) -> None:
        old, self.aengine = self.aengine, self._start_engine()
        if self.events is not None:
            self.events.engine_replaced(lambda: self.aengine.take_kv_events())
        old.shutdown()

    async def generate(self, req: PrefillRequest) -> AsyncGenerator[list[RequestOutput], None]:
        """The whole request, prefill and decode, as batches of outputs (waiting for a
        new engine core while this replica's is being replaced)."""
        if self.lost_replica() is not None:
            await self._engine_back()
        span = tracing.start_span("generate", req.trace, SpanKind.SERVER, {
            "duet.request_id": req.request_id, "duet.replica": self.replica_id,
            "gen_ai.usage.input_tokens": req.num_prompt_tokens,
        })
        try:
            try:
                stream = await self._start(req)
            except EngineDead:  # lost before the replica saw it: nothing ran, so it starts on the new one
                if not self._in_child or not await self._engine_back():
                    raise
                stream = await self._start(req)
        except BaseException as e:
            tracing.end_span(span, e)
            raise
        async with contextlib.aclosing(self.telemetry.traced(span, stream)) as batches:
            async for outs in batches:
                yield outs

    async def _start(self, req: PrefillRequest) -> AsyncGenerator[list[RequestOutput], None]:
        return await self.aengine.add_request(req.request_id, list(req.prompt_token_ids), req.sampling,
                                              req.cache_salt, req.fork_of)

    async def _engine_back(self) -> bool:
        return await self.restarts.wait_for_engine(lambda: self.lost_replica() is None, WAIT_FOR_RESTART_S)

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by Serve every `router.stats_period_s` for the aggregated router."""
        return RoutingStats.of_engine(
            self.aengine.stats, model_fingerprint=self.aengine.model_fingerprint,
            kv_log=self.events.window() if self.events is not None else None, serving=self.restarts.serving,
        ).to_wire()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Nothing of its own: one pool doing both phases scales by Serve's queue rule or
        not at all (the goodput policy needs a prefill and a decode pool)."""
        return {}

    async def stats(self) -> dict[str, Any]:
        engine_pid = self.aengine.info.pid if isinstance(self.aengine, EngineCoreClient) else None
        return {**self.aengine.stats.as_dict(), "replica_id": self.replica_id, "engine_pid": engine_pid,
                **(self.events.stats() if self.events is not None else {}), **self.restarts.stats()}

    def lost_replica(self) -> str | None:
        """This replica's id while its engine is lost (being replaced), else None."""
        try:
            self.aengine.check_health()
        except EngineDead:
            return self.replica_id
        return None

    async def check_health(self) -> None:
        """Fails only when the engine is gone for good (see `DecodeServer.check_health`)."""
        self.restarts.check_health()
        if not self._in_child:
            self.aengine.check_health()

    def shutdown(self) -> None:
        """Serve calls this (through `__del__`) once the replica's calls have ended."""
        if self._closed:
            return
        self._closed = True
        self.restarts.close()
        steps = [self.telemetry.close, self.aengine.shutdown]
        if self.events is not None:
            steps.append(self.events.close)
        close_in_order(steps, "aggregated")

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
