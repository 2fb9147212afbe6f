"""Speculative decoding: propose draft tokens, then verify them in one forward.

Two proposers draft: **n-gram** (prompt lookup, here) guesses that a decoding request
whose last few tokens appeared earlier in its own sequence (prompt or output)
continues the way they continued then; a **draft model** (engine/draft_model.py) runs
a smaller checkpoint with the same vocabulary greedily for a few tokens. Either way
the engine runs the request's pending token and the draft tokens as one chunk of the
step, so the model scores every draft position in the same forward; the engine keeps
the longest run the model agrees with (`accepted_prefix`), plus the model's own next
token.

Verification samples each position from the request's own distribution, exactly as
an unspeculated step would, and accepts a draft token only if the sample equals it.
With a point-mass draft that is the standard rejection rule (accept with p(x); on
rejection the residual max(p - q, 0) is p with x removed, which is what the sample
already is), so outputs keep the model's distribution; greedy outputs are identical
to no speculation. A seeded request draws one sample per scored position, so its
output is reproducible but not the same draw as without speculation.

Speculation pays when a step is bound by reading the weights (small batches): extra
rows then cost little. It is off above `max_batch_size` decoding requests, for rows
whose sampling depends on earlier tokens of the same step (penalties, grammars), and
for a request whose acceptance stays below `min_acceptance`.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import SpeculativeConfig
from engine.request import Request


def ngram_draft(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, trying n from `max_n` down to `min_n`; [] when none recurs."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n :])
        last = suffix[-1]
        # Scan end positions right to left: the latest match is the likeliest continuation.
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == suffix:
                return list(tokens[end + 1 : end + 1 + k])
    return []


class Proposer:
    """Decides which requests speculate and how many tokens they may draft; a subclass
    drafts them (`_draft`, or `_draft_all` for a step's requests at once). The
    scheduler calls `propose_all`; the engine calls `forget` when a request leaves it."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len

    def eligible(self, req: Request) -> bool:
        """Whether `req` may speculate at all: its rows sample independently of the
        tokens before them in the same step, and its acceptance has not proved low."""
        if req.sampling.needs_penalties or req.grammar is not None or req.stop_after_first_token:
            return False
        drafted, cfg = req.num_draft_tokens, self.cfg
        return drafted < cfg.probe_tokens or req.num_accepted_tokens >= cfg.min_acceptance * drafted

    def propose_all(self, reqs: list[Request], most: int, num_decoding: int) -> dict[str, list[int]]:
        """Draft tokens for the next step of each decode in `reqs`, by request id (the
        scheduler's hook); see `propose`."""
        todo = [(req, k) for req in reqs if (k := self._room(req, most, num_decoding)) > 0]
        drafts = self._draft_all(todo) if todo else []
        return {req.request_id: d for (req, _), d in zip(todo, drafts) if d}

    def propose(self, req: Request, most: int, num_decoding: int) -> list[int]:
        """Draft tokens for decode `req`'s next step: at most `most` (the step's room),
        none while more than `max_batch_size` requests decode, and leaving room for the
        sampled token within the request's max_tokens and the context."""
        return self.propose_all([req], most, num_decoding).get(req.request_id, [])

    def _room(self, req: Request, most: int, num_decoding: int) -> int:
        """How many tokens `req` may draft this step (0: none)."""
        cfg = self.cfg
        if num_decoding > cfg.max_batch_size or not self.eligible(req):
            return 0
        room = req.sampling.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1
        return max(0, min(cfg.num_tokens, most, *room))

    def _draft_all(self, todo: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to `k` draft tokens for each (request, k), in order."""
        return [self._draft(req, k) for req, k in todo]

    def _draft(self, req: Request, k: int) -> list[int]:
        raise NotImplementedError

    def forget(self, request_id: str) -> None:
        """`request_id` finished, was aborted or moved out: drop what is kept for it."""


class NgramProposer(Proposer):
    """Drafts from the request's own earlier tokens (prompt lookup)."""

    def _draft(self, req: Request, k: int) -> list[int]:
        cfg = self.cfg
        return ngram_draft(req.token_ids, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)


def accepted_prefix(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many draft tokens the verification samples accept (the leading run where the
    sample at a position equals the draft token there). `sampled` has one more entry
    than `draft`: the token after the last draft position."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n
