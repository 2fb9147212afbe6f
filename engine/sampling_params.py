"""Per-request sampling parameters, validated once at admission."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InvalidRequest

if TYPE_CHECKING:
    from engine.structured import StructuredOutput

# Integer fields become tensor elements (top_k, stop ids) or a generator seed: values
# past these bounds would overflow inside a step and take the whole batch with them.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; 0 = only the chosen token
    include_stop_str_in_output: bool = False
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to that token's logit
    # before sampling, greedy included (-100 all but bans it, +100 all but forces it).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured outputs: what every token must keep the output matching (engine/structured.py).
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or not 0 < self.max_tokens <= INT32_MAX:
            raise InvalidRequest("max_tokens", f"must be a positive 32-bit integer, got {self.max_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be finite and >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise InvalidRequest("top_k", f"must be -1 (off) or a 32-bit integer >= 0, got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_finite(v) or not -2.0 <= v <= 2.0:
                raise InvalidRequest(name, f"must be in [-2, 2], got {v!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty", f"must be finite and > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", f"must be non-negative 32-bit integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise InvalidRequest("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise InvalidRequest("seed", f"must be a 64-bit integer, got {self.seed!r}")
        bias = self.logit_bias
        if not isinstance(bias, dict) or not all(
            _is_int(t) and 0 <= t <= INT32_MAX and _is_finite(b) and -100 <= b <= 100 for t, b in bias.items()
        ):
            raise InvalidRequest("logit_bias", "must map token ids (non-negative integers) to biases in [-100, 100]")
        if self.structured is not None:
            self.structured.validate()

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this request names must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias)), ("stop_token_ids", self.stop_token_ids)):
            if any(t >= vocab_size for t in ids):
                raise InvalidRequest(name, f"token ids must be < {vocab_size}, the model's vocabulary size")

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
