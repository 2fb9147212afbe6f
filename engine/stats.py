"""`EngineStats`: one engine's state and counters at the end of a step.

The engine thread builds one after every step (and after commands that change the
block pool), and every reader takes that snapshot as it is: the replica's routing
stats, the autoscaling signals, the metrics reporter. Frozen, so a reader on another
thread never sees half an update. Counters are cumulative since the engine started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The scheduler's queues, the block pool and the external KV tier, at one instant."""

    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens waiting to be computed
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    num_exported: int = 0  # prefill: finished requests whose blocks wait for a lease
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_evictions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    external_kv_lookups: int = 0
    external_kv_hit_tokens: int = 0
    external_kv_loaded_tokens: int = 0
    external_kv_load_failures: int = 0
    external_kv_errors: int = 0
    # Speculative decoding: draft tokens scored and accepted, and the (request, step)
    # pairs that verified drafts (accepted + verify steps = the tokens those made).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    # `n` > 1: choices that forked another choice's prompt KV (shared blocks, the last
    # one copied) instead of computing or importing it.
    num_forks: int = 0
    # The requests the queue counts above count (waiting, then running): a router
    # takes off those it has seen finish since this snapshot was taken.
    request_ids: tuple[str, ...] = ()

    @property
    def num_requests(self) -> int:
        """Requests in the engine, waiting or running."""
        return self.num_running + self.num_waiting

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    def as_dict(self) -> dict[str, Any]:
        """Plain values for JSON surfaces (a replica's `stats()`, the metrics gauges)."""
        out = dataclasses.asdict(self)
        out["request_ids"] = list(self.request_ids)
        return out
