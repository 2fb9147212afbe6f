"""The aggregated pool: one engine runs both phases with chunked prefill, behind the
same gateway; the same-hardware baseline for every disaggregated figure.

It lives beside the decode pool because, like it, it streams tokens to the gateway;
unlike it, it prefills every prompt itself (that is its job, not a fallback).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.async_engine import start_engine
from engine.config import EngineConfig
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.replica import replica_id


class AggregatedServer:
    """Owns one aggregated-role engine. `engine` is a dumped `EngineConfig`."""

    def __init__(self, engine: dict, threads: int):
        self.replica_id = replica_id()
        self.aengine = start_engine(EngineConfig.model_validate(engine), "aggregated", threads)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[list[RequestOutput]]:
        eng = self.aengine.engine
        stream = await self.aengine.add(
            request_id, lambda: eng.add_request(prompt_token_ids, sampling, request_id=request_id)
        )
        async for outs in stream:
            yield outs

    async def stats(self) -> dict:
        return {**self.aengine.stats, "replica_id": self.replica_id}

    async def check_health(self) -> None:
        self.aengine.check_health()
