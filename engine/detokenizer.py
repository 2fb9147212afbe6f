"""Incremental detokenization and stop strings.

Text is emitted only once it is complete UTF-8: a character split across byte-level
tokens decodes to U+FFFD until its last byte arrives, so that text is held back.
While stop strings are set, the last `len(longest stop) - 1` characters are held
back too, so a stop string split across steps never leaks to the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine.request imports this module, and the tokenizer's imports import it
    from engine.tokenizer import Tokenizer

# Tokens of context re-decoded before the new ones, so merges at the boundary
# (leading spaces, multi-byte characters) come out right.
_CONTEXT_TOKENS = 6


@dataclass(frozen=True)
class DetokenizerState:
    """Where one request's detokenizer stands, to resume it in another engine: the
    tokens from the last settled context on (`read_offset` of them are settled), and
    the text from the earliest character a stop string may still start at, of which
    `emitted` characters the client has been sent."""

    tokens: tuple[int, ...]
    read_offset: int
    text: str
    emitted: int


class IncrementalDetokenizer:
    """Owns the text of one request's output and where the client has read to."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.emitted = 0  # characters of `text` already returned
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def state(self) -> DetokenizerState:
        keep = max(0, self.emitted - self.hold)
        return DetokenizerState(tuple(self.tokens[self.prefix_offset :]), self.read_offset - self.prefix_offset,
                                self.text[keep:], self.emitted - keep)

    @classmethod
    def resume(cls, tokenizer: Tokenizer, state: DetokenizerState, stop: list[str],
               include_stop: bool = False) -> IncrementalDetokenizer:
        """The detokenizer `state` was taken from, continuing where it stood."""
        detok = cls(tokenizer, [], stop, include_stop)
        detok.tokens, detok.read_offset = list(state.tokens), state.read_offset
        detok.text, detok.emitted = state.text, state.emitted
        return detok

    def add(self, token_ids: list[int]) -> tuple[str, bool]:
        """Append tokens; returns (new text for the client, whether a stop string hit)."""
        for tok in token_ids:
            self.tokens.append(tok)
            prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
        if self.stop:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold), False

    def flush(self) -> str:
        """Everything not yet returned (at finish)."""
        return self._take(len(self.text))

    def _find_stop(self) -> int | None:
        start = max(0, self.emitted - self.hold)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, len(s))
        if best is None:
            return None
        return best[0] + (best[1] if self.include_stop else 0)

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
