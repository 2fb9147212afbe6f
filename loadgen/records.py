"""Typed records that flow through loadgen: what to send, and what came back.

`Turn` and `Session` are produced by workloads; `RequestResult` is produced by the
client and is the only input of the metric functions, so every number in a report
can be recomputed from a list of results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Outcome(str, Enum):
    """How a request ended. Only COMPLETED requests have latencies, but all three
    count in the denominators (submitted requests, goodput ratio)."""

    COMPLETED = "completed"
    FAILED = "failed"  # HTTP error, connection refused, or an error in the stream
    UNFINISHED = "unfinished"  # timed out or the stream ended without finishing


@dataclass(frozen=True)
class Turn:
    """One user message of a session and the generation budget for its answer.

    `prompt` is the user text of this turn only; the runner prepends the session's
    history (system prompt, earlier turns and the server's actual answers)."""

    prompt: str
    prompt_tokens: int
    output_tokens: int
    think_time_s: float = 0.0  # pause before this turn is sent (multi-turn only)


@dataclass(frozen=True)
class Session:
    """A unit of work the arrival process schedules: one or more turns sent in
    order, each after the previous answer. Single-turn workloads have one turn.

    `arrival_s` is set only by trace replay, whose trace fixes the arrival times."""

    session_id: int
    turns: tuple[Turn, ...]
    system_prompt: str = ""
    system_prompt_tokens: int = 0
    arrival_s: float | None = None


@dataclass
class RequestResult:
    """Everything observed about one HTTP request. Times are `time.perf_counter()`
    seconds; `chunk_times[i]` is when the i-th non-empty streamed text arrived."""

    session_id: int
    turn_index: int
    prompt_tokens: int  # counted client-side, history included
    max_tokens: int
    ignore_eos: bool
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    text: str = ""
    outcome: Outcome = Outcome.UNFINISHED
    http_status: int | None = None
    error: str = ""
    end_time: float | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None  # from stream_options.include_usage
    warmup: bool = False

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["outcome"] = self.outcome.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestResult:
        d = dict(d)
        d["outcome"] = Outcome(d["outcome"])
        return cls(**d)
