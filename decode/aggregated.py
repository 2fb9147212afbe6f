"""The aggregated pool: one engine runs both phases with chunked prefill, behind the
same gateway; the same-hardware baseline for every disaggregated figure.

It lives beside the decode pool because, like it, it streams tokens to the gateway;
unlike it, it prefills every prompt itself (that is its job, not a fallback).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.request import RequestOutput
from kvtransfer.messages import PrefillRequest
from kvtransfer.replica import replica_id
from telemetry import tracing
from telemetry.replica import ReplicaTelemetry
from telemetry.tracing import SpanKind


class AggregatedServer:
    """Owns one aggregated-role engine. `engine` is a dumped `EngineConfig`,
    `telemetry` a `TelemetryConfig`."""

    def __init__(self, engine: dict, threads: int, telemetry: dict | None = None):
        self.replica_id = replica_id()
        self.aengine = start_engine(EngineConfig.model_validate(engine), "aggregated", threads)
        self.telemetry = ReplicaTelemetry(telemetry, "aggregated", self.replica_id,
                                         lambda: self.aengine.stats.as_dict())

    async def generate(self, req: PrefillRequest) -> AsyncIterator[list[RequestOutput]]:
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

    async def stats(self) -> dict[str, Any]:
        return {**self.aengine.stats.as_dict(), "replica_id": self.replica_id}

    async def check_health(self) -> None:
        self.aengine.check_health()
