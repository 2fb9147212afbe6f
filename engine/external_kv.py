"""The engine's hook to a KV cache beyond its own block pool (e.g. LMCache tiers).

`Engine` consults an `ExternalKVCache` when it admits a request (after its own
prefix cache) and hands it the prompt's KV when the prompt's prefill completes.
The engine owns the blocks; the external cache only reads or writes the blocks it
is passed, during the call, on the engine thread. Implementations live outside
`engine/` (prefill/kv_tier/tier.py); this file only fixes the contract.

An engine on a thread can be handed a live cache; an engine core process cannot. So
a replica names its cache with an `ExternalKVSpec` (a factory's import path and its
settings), and whichever runs the engine builds it around the engine's KV tensor,
owns it, ships its counters with the stats and closes it (`ManagedExternalKV`), the
way vLLM names a KV connector by its module path.

Granularity: an external cache works in chunks of `chunk_size` tokens (a multiple
of the engine's block size); every hit and every load starts and ends on a chunk
boundary. Failures are the implementation's to count: `load` returns how many
tokens it really wrote and the engine computes the rest.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ExternalKVCache(Protocol):
    @property
    def chunk_size(self) -> int:
        """Tokens per chunk: the unit it stores and loads (a multiple of the block size)."""

    # `cache_salt` (every method): the request's KV namespace (engine/hashing.py): a
    # chunk stored under one salt is never found under another, nor without one.

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens of `token_ids` whose KV it holds (a multiple of chunk_size)."""

    def load(
        self, token_ids: Sequence[int], block_ids: Sequence[int], start: int, end: int, cache_salt: str | None = None
    ) -> int:
        """Write the KV of tokens [start, end) into `block_ids` (the request's block
        table, position p lives in block_ids[p // block_size]). `start` and `end`
        are chunk-aligned. Returns `t` such that [start, t) was written."""

    # Optional: an attribute `last_load_sources: dict[str, int]`, the tokens of the
    # last `load` by where they came from (e.g. {"cpu": 256, "redis": 128}); the engine
    # reads it right after `load`, on the same thread, for each request's metrics.

    def store(
        self, token_ids: Sequence[int], block_ids: Sequence[int], num_tokens: int, cache_salt: str | None = None
    ) -> object:
        """Keep the KV of the leading full chunks of `num_tokens` computed tokens (what
        it returns is its own: the engine ignores it)."""


class ManagedExternalKV(ExternalKVCache, Protocol):
    """An external cache that whoever runs the engine owns: built by an `ExternalKVSpec`."""

    def as_dict(self) -> dict[str, Any]:
        """Its counters, flat (merged into the replica's stats and metrics)."""

    def close(self) -> None:
        """Flush and let go; returns within the spec's `close_timeout_s`."""


@dataclass(frozen=True)
class ExternalKVSpec:
    """An external KV cache named, not built. `factory` is `"module:callable"`, called
    as `factory(config, kv, model_fingerprint)` with the engine's KV tensor; it returns
    a `ManagedExternalKV`. The module is the caller's (e.g. prefill/kv_tier), so the
    engine imports it only by this name."""

    factory: str
    config: dict[str, Any] = field(default_factory=dict)
    close_timeout_s: float = 5.0  # how long its `close` may take (a stopping engine waits for it)

    def build(self, kv: torch.Tensor, model_fingerprint: str) -> ManagedExternalKV:
        module, _, name = self.factory.partition(":")
        make = getattr(importlib.import_module(module), name)
        return make(self.config, kv, model_fingerprint)


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """An external cache's chunks must hold whole blocks; raises ValueError otherwise."""
    if chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(f"chunk_size {chunk_size} must be a positive multiple of block_size {block_size}")
