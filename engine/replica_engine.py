"""`ReplicaEngine`: what a replica uses of its engine, wherever the engine runs.

A replica holds either an `AsyncEngine` (engine/async_engine.py: the engine on a thread
of the replica's process) or an `EngineCoreClient` (engine/core_client.py: the engine
in a child process). Both implement this one interface; the prefill, decode and
aggregated servers are typed against it, so the type checker says when the two drift
apart.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import torch

from engine.engine import MovedSequence
from engine.kv_events import KVEvent
from engine.request import RequestOutput, ResumeState
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


class ReplicaEngine(Protocol):
    model_id: str
    model_fingerprint: str  # part of every block hash (engine.engine.Engine.model_fingerprint)
    block_size: int
    num_kv_blocks: int
    stream_interval: int
    stats: EngineStats  # the snapshot after the engine's last step or command

    @property
    def kv_data(self) -> torch.Tensor:
        """The engine's KV tensor in this process, for the transfer backend to register."""

    @property
    def external_kv_stats(self) -> dict[str, Any]:
        """The external KV cache's counters (a prefill replica's LMCache tier); {} without one."""

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, cache_salt: str | None = None,
        fork_of: str | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """Start a request from its prompt; its stream of output batches. Leaving the
        stream before it finished aborts the request. `fork_of`: a choice of the same
        request whose prompt KV it may fork."""

    async def add_imported_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        sampling: SamplingParams,
        take_blocks: Callable[[], list[int] | None],
        cache_salt: str | None = None,
        resume: ResumeState | None = None,
    ) -> AsyncGenerator[list[RequestOutput], None]:
        """Start a request whose prompt KV was imported into `kv_data`: `take_blocks`
        hands over the blocks holding it (None: recompute the prompt) as the request is
        started; from then on the engine frees them, also if it refuses the request.
        `resume`: a sequence another engine moved out."""

    async def reserve_blocks(self, num_tokens: int) -> list[int] | None:
        """Free blocks for `num_tokens` of imported KV, or None while the pool (or the
        running batch) is full."""

    def could_ever_hold(self, num_tokens: int) -> bool:
        """Whether the whole pool, empty, holds `num_tokens`."""

    def release_blocks(self, block_ids: list[int]) -> concurrent.futures.Future:
        """Free blocks nobody will use; from any thread, without waiting."""

    async def move_out(self, request_ids: list[str], on_moved: Callable[[MovedSequence], None]) -> list[str]:
        """Take these requests' decoding sequences out of the engine; `on_moved` leases
        each before its stream ends (one that raises has its blocks freed). Returns the
        ids moved."""

    async def abort(self, request_id: str) -> None: ...

    def take_kv_events(self) -> list[KVEvent]:
        """The block pool's KV events since the last call (for the prefix index)."""

    def check_health(self) -> None:
        """Raise if the engine is gone (Serve's health check then restarts the replica)."""

    def shutdown(self) -> None: ...


def pool_holds(num_tokens: int, block_size: int, num_blocks: int) -> bool:
    """Whether `num_blocks` blocks of `block_size` tokens hold `num_tokens` (the
    implementations' `could_ever_hold`: a pool's size never changes)."""
    return -(-num_tokens // block_size) <= num_blocks
