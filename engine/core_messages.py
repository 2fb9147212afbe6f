"""The replica ↔ engine core protocol: one typed message per command and per reply.

The replica (engine/core_client.py) and its engine core child (engine/core_process.py)
talk over a Unix socket pair (`multiprocessing.connection.Connection`), which pickles
each message. Every message is one of the frozen dataclasses below, so both ends
match on a type and read named fields, and the type checker sees a field renamed on
one side only.

Parent → child: `Init` first; then `Call`s, each a command (`Add`, `AddImported`,
`Reserve`, `Release`, `MoveOut`, `Abort`) under the call id its `Reply` answers;
`Stop` last. Child → parent: `Ready` once it is warm (with a shared KV tensor, its
memfd follows on the socket: `SharedKV.send`), a `Reply` per call, one `Step` per
engine step, and `Died` before a fatal exit.

Why pickled dataclasses and not msgspec: one step message of 32 outputs round-trips
(encode + decode) in 77 us as this `Step` dataclass, the same as the positional tuple
it replaced, against 8 us as msgspec Structs with the stats flattened (an optimistic
bound; scripts/experiments/core_messages.py, docs/bench/bench_core_messages.json,
2-core AMD EPYC with avx512_bf16). The ~70 us saved is ~0.1% of a 60-120 ms step on
these CPUs; msgspec would also need every payload type (`RequestOutput`, `EngineStats`,
the KV events, a `ResumeState`'s sampler state) rewritten as Structs, and a `Reply`
carries exceptions and `MovedSequence`s, which only pickle carries as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import Role
    from engine.engine import ExportedKV
    from engine.external_kv import ExternalKVSpec
    from engine.kv_cache import SharedKV
    from engine.kv_events import KVEvent
    from engine.request import RequestOutput, ResumeState
    from engine.sampling_params import SamplingParams
    from engine.stats import EngineStats


# ---------------------------------------------------------------- parent → child
@dataclass(frozen=True, slots=True)
class Init:
    """The first message: what engine to build. `share_kv`: its KV tensor in shared
    memory (prefill, decode); `external_kv`: the external KV cache to attach after
    the warm-up (a prefill replica's LMCache tier)."""

    engine: dict[str, Any]  # a dumped EngineConfig
    role: Role
    threads: int
    kv_events: bool
    share_kv: bool
    external_kv: ExternalKVSpec | None


@dataclass(frozen=True, slots=True)
class Add:
    """Start a request from its prompt; `fork_of` another choice whose prompt KV it may fork."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    fork_of: str | None = None


@dataclass(frozen=True, slots=True)
class AddImported:
    """Start a request whose prompt KV is in `block_ids` (None: recompute it); with
    `resume`, a sequence another engine moved out."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    sampling: SamplingParams
    block_ids: list[int] | None
    cache_salt: str | None = None
    resume: ResumeState | None = None


@dataclass(frozen=True, slots=True)
class Reserve:
    """Free blocks for `num_tokens` of imported KV (the reply: their ids, or None)."""

    num_tokens: int


@dataclass(frozen=True, slots=True)
class Release:
    """Free blocks nobody will use."""

    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class MoveOut:
    """Take these decoding sequences out (the reply: their `MovedSequence`s)."""

    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


Command = Add | AddImported | Reserve | Release | MoveOut | Abort


@dataclass(frozen=True, slots=True)
class Call:
    """A command, and the id of the call its `Reply` answers."""

    call_id: int
    command: Command


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop stepping, close the external cache, exit."""


# ---------------------------------------------------------------- child → parent
@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the replica's side needs to know of the engine, sent once it is warm."""

    model_id: str
    model_fingerprint: str
    block_size: int
    num_kv_blocks: int
    stream_interval: int
    pid: int
    shared_kv: SharedKV | None  # the KV tensor, for the replica to register with its transfer backend


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo
    stats: EngineStats
    external_kv_stats: dict[str, Any] | None  # the external cache's counters; None without one


@dataclass(frozen=True, slots=True)
class Reply:
    """A call's answer: its value, or (`ok` False) the exception it raised."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step: every request's new outputs, the stats after it, its KV events,
    a prefill engine's exports (for the replica to lease before it delivers the
    outputs), and the external cache's counters (None without one)."""

    outputs: list[RequestOutput]
    stats: EngineStats
    kv_events: list[KVEvent]
    exports: list[ExportedKV]
    external_kv_stats: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Died:
    """The child is exiting on an error: its text and traceback."""

    message: str


ToChild = Init | Call | Stop
ToParent = Ready | Reply | Step | Died
