"""The aggregated pool: one engine runs both phases with chunked prefill, behind
the same gateway; the same-hardware baseline for every disaggregated figure."""

from __future__ import annotations

from collections.abc import AsyncIterator

from cluster.config import ClusterConfig
from cluster.replica import replica_id, start_engine
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams


class AggregatedServer:
    """Owns one aggregated-role engine."""

    def __init__(self, config: dict):
        cfg = ClusterConfig.model_validate(config)
        self.replica_id = replica_id()
        self.aengine = start_engine(cfg, cfg.aggregated, role="aggregated")

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[list[RequestOutput]]:
        engine = self.aengine.engine
        stream = await self.aengine.add(
            request_id, lambda: engine.add_request(prompt_token_ids, sampling, request_id=request_id)
        )
        async for outs in stream:
            yield outs

    async def stats(self) -> dict:
        return {**self.aengine.stats, "replica_id": self.replica_id}

    async def take_kv_events(self) -> list:
        return self.aengine.take_kv_events()

    async def check_health(self) -> None:
        self.aengine.check_health()
