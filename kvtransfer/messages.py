"""Typed messages of the prefill -> decode handoff, aborts included.

Every hop is a frozen dataclass (Ray pickles them between replicas); nothing here
holds a tensor or a connection. The flow (docs/ARCHITECTURE.md, "One request"):

    gateway  --PrefillRequest-->  prefill  --PrefillResult(kv_handle)-->  gateway
    gateway  --DecodeRequest(kv_handle)-->  decode
    decode   --Release | Reject-->  prefill            (ends the lease)
    decode   --SequenceMoved(DecodeRequest)-->  gateway  (it drains: its KV leased)
    gateway  --DecodeRequest(its kv_handle)-->  another decode
    gateway  --Reject(client_disconnected)-->  prefill (nobody will pull it)

A client that goes away after decode started is a cancelled Serve call: the
replica aborts the request in its engine and frees its blocks.

Replicas report `RoutingStats` to the routers (Serve carries them as a dict).
Per-request state that must follow a request across hops (a structured-output
grammar's state, a tenant's cache salt) belongs in `PrefillRequest` and
`DecodeRequest`, so a prefill, a handoff and a migration all continue one request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from engine.request import FinishReason, ResumeState
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from kvtransfer.backends.base import PeerInfo
from kvtransfer.events.log import KVLogWindow
from kvtransfer.layout import LayoutFingerprint

# The W3C trace context a caller passes on (telemetry/tracing.py `carrier`).
TraceCarrier = dict[str, str]


@dataclass(frozen=True)
class KVHandle:
    """Owns the claim on a prefill replica's leased KV blocks for one request.

    ``peer`` is the backend's connection info (e.g. a NIXL agent's metadata, or a
    TCPStore host/port), so decode can pull without a lookup service.
    ``lease_expiry`` is wall-clock unix time: replicas may live on different hosts,
    so a monotonic clock would mean nothing to the receiver.
    """

    request_id: str
    # The replica that granted the lease: a prefill replica, or a draining decode
    # replica handing a running sequence on (`SequenceMoved`).
    prefill_replica_id: str
    backend: str
    peer: PeerInfo
    block_ids: tuple[int, ...]
    num_tokens: int
    fingerprint: LayoutFingerprint
    lease_id: str
    lease_expiry: float
    # Where the owner listens for Release / Reject, and the key (hex) that signs
    # them for this lease alone (kvtransfer/control.py).
    control_address: tuple[str, int] | None = None
    control_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        needed = math.ceil(self.num_tokens / self.fingerprint.block_size)
        if len(self.block_ids) != needed:
            raise ValueError(
                f"KVHandle for {self.num_tokens} tokens needs {needed} blocks of "
                f"{self.fingerprint.block_size}, got {len(self.block_ids)}"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.fingerprint.bytes_per_block

    def expired(self, now: float | None = None) -> bool:
        """True once the lease has run out; pulling then may read reused blocks."""
        return (time.time() if now is None else now) >= self.lease_expiry

    def seconds_left(self, now: float | None = None) -> float:
        return self.lease_expiry - (time.time() if now is None else now)


@dataclass(frozen=True)
class PrefillRequest:
    """One request from its prompt: what the gateway sends a prefill replica (which
    computes the prompt and samples the first token) or an aggregated one (which
    generates all of it). The routers read its fields to choose the replica."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str | None = None  # `x-session-id`: an affinity hint for the prefill router
    trace: TraceCarrier | None = None
    # The tenant's KV namespace (engine/hashing.py `chain_root`): the router hashes the
    # prompt with it, and every replica caches and looks up the request's KV under it.
    cache_salt: str | None = None
    # `n` > 1: the id of another choice of this request, decoding on some replica. The
    # router sends this one to that replica, whose engine forks that choice's prompt KV
    # (`engine.request.Request.fork_of`) instead of prefilling or importing it again.
    fork_of: str | None = None
    # Decode replicas this request must not go to: the gateway's own, once its engine is
    # lost (the decode router honours it while another replica is there).
    avoid_replicas: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class PrefillResult:
    """What prefill returns: the first token at once, and the KV to hand off.

    ``kv_handle`` is None when the request finished at prefill (e.g. the first
    token was EOS or ``max_tokens == 1``); no lease was granted then.
    """

    request_id: str
    # None only when the request ended at prefill before any token (its grammar's dead end).
    first_token: int | None
    kv_handle: KVHandle | None
    num_cached_tokens: int
    num_prompt_tokens: int
    first_token_logprobs: Any = None
    text: str = ""  # the first token's text (stop strings already applied)
    finish_reason: FinishReason | None = None  # set when the request ended at prefill


@dataclass(frozen=True)
class DecodeRequest:
    """What the gateway sends decode: enough to continue generating after the first token."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token: int
    sampling: SamplingParams
    kv_handle: KVHandle
    trace: TraceCarrier | None = None
    cache_salt: str | None = None  # as in PrefillRequest: the imported blocks are cached under it
    # A sequence a draining decode replica moved (`SequenceMoved`): its output so far is
    # the tail of prompt_token_ids + first_token, and its sampler state goes on.
    resume: ResumeState | None = None
    avoid_replicas: tuple[str, ...] = ()  # as in PrefillRequest

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if self.kv_handle.num_tokens != len(self.prompt_token_ids):
            raise ValueError(
                f"kv_handle covers {self.kv_handle.num_tokens} tokens, prompt has "
                f"{len(self.prompt_token_ids)}"
            )


@dataclass(frozen=True)
class SequenceMoved:
    """What a draining decode replica streams in place of a request's next tokens: the
    request goes on elsewhere from `request`, whose handle leases the KV of every token
    so far on the draining replica (granted like a prefill's). The caller sends it to
    another decode replica; the client's stream goes on without a prefill."""

    request: DecodeRequest
    from_replica: str


class RejectReason(StrEnum):
    """Why a lease is rejected; prefill frees the blocks at once either way."""

    NO_FREE_BLOCKS = "no_free_blocks"
    LAYOUT_MISMATCH = "layout_mismatch"
    BACKEND_MISMATCH = "backend_mismatch"
    PEER_MISMATCH = "peer_mismatch"  # the transfer peer is not the replica that granted the lease
    LEASE_EXPIRED = "lease_expired"
    TRANSFER_FAILED = "transfer_failed"
    # The gateway: the client went away between prefill and decode.
    CLIENT_DISCONNECTED = "client_disconnected"
    # The gateway: the decode replica was lost and the request migrated elsewhere.
    DECODE_LOST = "decode_lost"


@dataclass(frozen=True)
class Release:
    """Decode has its copy of the KV: prefill may unpin the blocks (they stay as prefix cache)."""

    request_id: str
    lease_id: str


@dataclass(frozen=True)
class Reject:
    """Decode will not (or could not) import the KV: prefill frees the lease at once."""

    request_id: str
    lease_id: str
    reason: str


class ImportFailed(RuntimeError):
    """Decode could not import a request's KV (and did not recompute). Raised in the
    decode replica; Ray re-raises it with this type in the gateway."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"KV import failed ({reason}): {detail}")
        self.reason = reason

    def __reduce__(self):
        return (ImportFailed, (self.reason, str(self).split("): ", 1)[-1]))


@dataclass(frozen=True)
class RoutingStats:
    """What a pool replica reports to every router (Serve's `record_routing_stats`,
    every `router.stats_period_s`). On the wire it is a dict (`to_wire`), since Serve
    passes it through its controller; routers read it back with `from_wire`.
    A replica that has not reported yet reads as idle, its free blocks unknown (None):
    the prefill router counts none free, the decode router all."""

    num_requests: int = 0  # waiting + running
    queued_prefill_tokens: int = 0
    kv_blocks_free: int | None = None  # None: not reported
    kv_blocks_total: int = 0
    # The requests the counts above count: a router takes off those it saw finish since.
    request_ids: tuple[str, ...] = ()
    model_fingerprint: str | None = None  # prefill: what prompts are hashed with
    kv_log: KVLogWindow | None = None  # prefill, `router.prefix_index: memory`: its KV events
    serving: bool = True  # False while its engine core is being replaced: not chosen while another is

    @classmethod
    def of_engine(cls, stats: EngineStats, **extra: Any) -> RoutingStats:
        return cls(
            num_requests=stats.num_requests,
            queued_prefill_tokens=stats.queued_prefill_tokens,
            kv_blocks_free=stats.kv_blocks_free,
            kv_blocks_total=stats.kv_blocks_total,
            request_ids=stats.request_ids,
            **extra,
        )

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_wire(cls, stats: Mapping[str, Any] | None) -> RoutingStats:
        if not stats:
            return cls()
        known = {k: v for k, v in stats.items() if k in cls.__dataclass_fields__ and v is not None}
        if "request_ids" in known:
            known["request_ids"] = tuple(known["request_ids"])
        return cls(**known)
