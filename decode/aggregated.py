"""The aggregated pool: one engine runs both phases with chunked prefill, behind the
same gateway; the same-hardware baseline for every disaggregated figure.

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
from engine.replica_engine import ReplicaEngine
from engine.request import RequestOutput
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

    def __init__(self, engine: dict, threads: int, telemetry: dict | None = None,
                 prefix_index: dict | None = None, engine_process: bool = False):
        self.replica_id = replica_id()
        engine_cfg = EngineConfig.model_validate(engine)
        kv_events = prefix_index is not None
        # `engine_process`: the engine core in a child process (no GIL shared with
        # this replica's event loop); otherwise on a thread of this process.
        self.aengine: ReplicaEngine = (
            EngineCoreClient(engine_cfg, "aggregated", threads, kv_events=kv_events) if engine_process
            else start_engine(engine_cfg, "aggregated", threads, kv_events=kv_events))
        self.events = None if prefix_index is None else KVEventPublisher(
            PrefixIndexConfig.model_validate(prefix_index).of_pool("aggregated"), engine_cfg.block_size,
            self.replica_id, self.aengine.take_kv_events)
        self.telemetry = ReplicaTelemetry(telemetry, "aggregated", self.replica_id,
                                         lambda: self.aengine.stats.as_dict())
        self._closed = False

    async def generate(self, req: PrefillRequest) -> AsyncGenerator[list[RequestOutput], None]:
        """The whole request, prefill and decode, as batches of outputs."""
        span = tracing.start_span("generate", req.trace, SpanKind.SERVER, {
            "duet.request_id": req.request_id, "duet.replica": self.replica_id,
            "gen_ai.usage.input_tokens": req.num_prompt_tokens,
        })
        try:
            stream = await self.aengine.add_request(req.request_id, list(req.prompt_token_ids), req.sampling,
                                                    req.cache_salt, req.fork_of)
        except BaseException as e:
            tracing.end_span(span, e)
            raise
        async with contextlib.aclosing(self.telemetry.traced(span, stream)) as batches:
            async for outs in batches:
                yield outs

    def record_routing_stats(self) -> dict[str, Any]:
        """Read by Serve every `router.stats_period_s` for the aggregated router."""
        return RoutingStats.of_engine(
            self.aengine.stats, model_fingerprint=self.aengine.model_fingerprint,
            kv_log=self.events.window() if self.events is not None else None,
        ).to_wire()

    async def stats(self) -> dict[str, Any]:
        engine_pid = self.aengine.info.pid if isinstance(self.aengine, EngineCoreClient) else None
        return {**self.aengine.stats.as_dict(), "replica_id": self.replica_id, "engine_pid": engine_pid,
                **(self.events.stats() if self.events is not None else {})}

    async def check_health(self) -> None:
        self.aengine.check_health()

    def shutdown(self) -> None:
        """Serve calls this (through `__del__`) once the replica's calls have ended."""
        if self._closed:
            return
        self._closed = True
        steps = [self.telemetry.close, self.aengine.shutdown]
        if self.events is not None:
            steps.append(self.events.close)
        close_in_order(steps, "aggregated")

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
