"""A request's state inside one engine, and what the engine reports back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import DetokenizerState
from engine.hashing import BlockHash
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.structured import GrammarMatcher


class EngineDead(RuntimeError):
    """The engine stopped (its thread or its child process): every request on it fails."""


class RequestFailed(RuntimeError):
    """One request failed inside the engine (the engine goes on serving the others)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    PREFILL_DONE = "prefill_done"  # prefill role: first token sampled, KV exported
    # A structured output's grammar allowed no further token (its matcher failed); the
    # output is the longest valid prefix of a document, not a whole one.
    GRAMMAR_DEAD_END = "grammar_dead_end"
    # The running sequence left this engine with its KV pinned, to continue on another
    # replica (a draining decode replica hands its sequences on); never a client's.
    MOVED = "moved"


@dataclass
class Request:
    """Owns one sequence: its tokens, progress, block table and sampling state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # prefill role: finish after the first sampled token and keep the blocks pinned.
    stop_after_first_token: bool = False
    # Its tenant's KV namespace (engine/hashing.py `chain_root`): no block is shared
    # with a request of another salt, in the pool or in the external cache.
    cache_salt: str | None = None
    # `n` > 1: another choice of the same request (same prompt and salt). While that
    # one runs here with its prompt computed, this one forks its KV instead of
    # computing it (`Scheduler`, `KVCacheManager.fork`).
    fork_of: str | None = None

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_hashed_blocks_cached: int = 0  # leading blocks already registered in the pool
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 = not yet scheduled
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # structured outputs: the tokens allowed next
    # When it was first scheduled and sampled its first token (monotonic), and where its
    # cached prompt tokens came from: for traces and queue-wait metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (engine/speculative.py): draft tokens scored, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class ResumeState:
    """What a sequence continued in another engine needs besides its KV and tokens:
    how many of its tokens are output (max_tokens, penalties and its grammar count
    them), its seeded sampler's generator, its detokenizer (text held back for a
    partial character or a possible stop string), and its prompt's cache hit."""

    num_output_tokens: int
    generator_state: bytes | None
    detokenizer: DetokenizerState
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """How one request went through one engine (monotonic seconds); on the final
    output only. `cached_tokens_by_source`: `pool` (the engine's own prefix cache)
    and the external cache's sources (e.g. LMCache `cpu`, `disk`, `redis`)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_preemptions: int
    cached_tokens_by_source: dict[str, int]
    num_draft_tokens: int = 0  # speculative decoding: draft tokens scored, and accepted
    num_accepted_tokens: int = 0

    @property
    def queue_s(self) -> float:
        """Waiting before the first step (the whole life of a request never scheduled)."""
        return (self.first_scheduled_time or self.finished_time) - self.arrival_time


@dataclass
class RequestOutput:
    """One step's news about one request."""

    request_id: str
    new_token_ids: list[int]
    text: str  # new text since the last output (stop strings already cut)
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None  # set when finished
    error: str | None = None  # set when it failed inside the engine (finish_reason ABORT)
