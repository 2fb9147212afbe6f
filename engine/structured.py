"""Structured outputs: a request's JSON schema, "any JSON object", regular expression
or list of choices, turned into a token-level grammar that masks every step's logits
(llguidance: see `python scripts/experiments/grammar.py` for why this library).

What travels with a request (inside `SamplingParams`, so across the prefill → decode
hop too) is the `StructuredOutput` spec, never a matcher: an engine that takes a
request over (decode after a handoff, a migration, a recompute) builds a fresh
matcher and replays the request's output tokens into it, so the grammar's state is
always a function of the tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

import llguidance

from engine.errors import InvalidRequest

if TYPE_CHECKING:  # torch is the engine's: the gateway validates grammars without it
    import torch
    from llguidance._lib import JsonCompileOptions

    from engine.tokenizer import Tokenizer

Kind = Literal["json_object", "json_schema", "regex", "choice", "lark"]

# Compact, deterministic JSON: a small model given free whitespace can spend its whole
# budget on newlines. ", " and ": " keep the text as people write it.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}
_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` is the JSON schema's text (json_schema), the
    pattern (regex), a JSON list of strings (choice), llguidance's Lark grammar (lark:
    a tool call inside its format's tags), or empty (json_object). `param`
    is the request field it came from, for errors. `prefix`: output tokens an earlier
    pass already produced (a migrated request's continuation resumes the document)."""

    kind: Kind
    spec: str = ""
    param: str = "response_format"
    prefix: tuple[int, ...] = ()

    @classmethod
    def json_schema(cls, schema: object, param: str = "response_format") -> StructuredOutput:
        if not isinstance(schema, dict):
            raise InvalidRequest(param, f"the JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), param)

    @classmethod
    def choice(cls, choices: object, param: str = "guided_choice") -> StructuredOutput:
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequest(param, "must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices), param)

    def grammar(self) -> str:
        """llguidance's grammar text; an invalid spec is an `InvalidRequest` naming `param`."""
        try:
            return _grammar(self.kind, self.spec)
        except ValueError as e:
            raise InvalidRequest(self.param, f"invalid {self.kind.replace('_', ' ')}: {e}") from e

    def validate(self) -> None:
        self.grammar()


@lru_cache(maxsize=256)
def _grammar(kind: Kind, spec: str) -> str:
    """The grammar text of a spec, validated once (the gateway, the pools' admission
    checks and each matcher all ask for it; an invalid one raises and is not cached)."""
    match kind:
        case "json_object" | "json_schema":
            text = llguidance.LLMatcher.grammar_from_json_schema(spec or _ANY_OBJECT, defaults=_JSON_OPTIONS)
        case "regex":
            text = llguidance.LLMatcher.grammar_from_regex(spec)
        case "choice":
            text = llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(spec)))
        case "lark":
            text = llguidance.LLMatcher.grammar_from_lark(spec)
        case _:
            raise ValueError(f"unknown structured output kind {kind!r}")
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(error)
    return text


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` ([rows, ceil(vocab / 32)] int32): bit set = allowed."""
        r = bitmask[row]
        self._m.unsafe_compute_mask_ptr(r.data_ptr(), r.numel() * r.element_size())

    @staticmethod
    def fill_bitmasks(matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` for `matchers[i]`, filled on llguidance's own threads (a
        mask inside a JSON string takes up to ~1 ms a row on this CPU; the rows of one
        step are independent)."""
        import torch

        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32
        one = bitmask.shape[1] * bitmask.element_size()
        _executor().unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), one,
                                            bitmask.shape[0])

    def consume(self, token_ids: list[int]) -> None:
        """Replay tokens already accepted (a prefix, a request taken over): a refusal
        means they were never this grammar's, so it raises."""
        if not self.advance(token_ids):
            raise RuntimeError(f"the grammar refused token(s) {token_ids}: {self.error}")

    def advance(self, token_ids: list[int]) -> bool:
        """Take newly sampled tokens; False at a dead end (the matcher failed, e.g. on
        one of llguidance's limits, and allows nothing more), with `error` saying why."""
        return bool(self._m.consume_tokens(token_ids)) and not self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error() or ""

    @property
    def is_stopped(self) -> bool:
        """Nothing more may be generated (the document is complete, or EOS consumed)."""
        return bool(self._m.is_stopped())


class Grammars:
    """One engine's grammar compiler: the tokenizer's llguidance view, built once (~0.4 s)
    on the first structured request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer_source = tokenizer  # its `hf` imports transformers: read it on first use
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None

    def matcher(self, spec: StructuredOutput, output_token_ids: list[int]) -> GrammarMatcher:
        """A matcher for `spec` that has consumed its prefix and `output_token_ids` (a
        request taken over)."""
        if self._tokenizer is None:
            # Here, not at the top: llguidance.hf imports transformers (~0.8 s of CPU),
            # which a process that never compiles a grammar (Serve's app build, the
            # unit tests) need not pay.
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(self._tokenizer_source.hf, n_vocab=self.vocab_size)
        m = llguidance.LLMatcher(self._tokenizer, spec.grammar())
        if m.is_error():
            raise InvalidRequest(spec.param, m.get_error())
        matcher = GrammarMatcher(m)
        if spec.prefix or output_token_ids:
            matcher.consume([*spec.prefix, *output_token_ids])
        return matcher


@lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    import torch

    return llguidance.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))


@lru_cache(maxsize=1)
def _byte_to_bias() -> torch.Tensor:
    """Byte value -> what to add to its 8 tokens' logits (0 where the bit is set, -inf
    where not). Adding it, one lookup per mask byte, measured 2.3 ms for 32 rows of a
    49,152-token vocabulary here, against 6.1 ms for shifting every bit out and filling."""
    import torch

    return torch.where(((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in `bitmask` is clear (rows match;
    bit b of word w is token 32 w + b, stored little-endian)."""
    vocab = logits.shape[1]
    import torch

    bias = _byte_to_bias().to(logits.device, logits.dtype)[bitmask.view(torch.uint8).long().to(logits.device)]
    logits += bias.reshape(bitmask.shape[0], -1)[:, :vocab]
