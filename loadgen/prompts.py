"""Prompt text of a requested token length, built from ordinary English words.

Random words (not random token ids, as some benchmarks use) keep prompts valid
text for a chat template, and random order keeps prefixes distinct so a prefix
cache only hits where a workload means it to (shared-prefix workloads).
"""

from __future__ import annotations

import numpy as np

from loadgen.tokenizer import TokenizerLike

# A small self-written corpus; only its vocabulary is used.
_CORPUS = """
The river runs past the old mill where farmers bring grain every autumn. Engineers
measure how long each request waits in the queue before the server answers, and
they plot latency against throughput to find the knee of the curve. A careful
planner keeps spare capacity for bursts of traffic, because arrivals are random
and a busy replica makes every later request slower. Mountains, forests, cities,
harbours, bridges and libraries appear in stories about travel, history, science,
music, weather, cooking, mathematics, astronomy and the quiet work of gardeners.
Students read books about light, energy, motion, water, stone, metal, glass and
time; teachers answer questions with patience, and a good question often matters
more than a quick answer. Morning trains carry workers north while evening ships
return south with fish, salt, cotton, paper and letters from distant friends.
"""


class PromptBuilder:
    """Owns the tokenized vocabulary and turns (length, rng) into prompt text.

    Each word is tokenized once with a leading space; GPT-2-style pre-tokenization
    splits on spaces, so the concatenated pieces re-tokenize to (almost exactly)
    the requested count."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        words = sorted({w.strip(".,;:").lower() for w in _CORPUS.split()} - {""})
        self._pieces = [tokenizer.encode(" " + w, add_special_tokens=False) for w in words]
        self._mean_len = float(np.mean([len(p) for p in self._pieces]))

    def token_ids(self, n_tokens: int, rng: np.random.Generator) -> list[int]:
        ids: list[int] = []
        while len(ids) < n_tokens:
            need = int((n_tokens - len(ids)) / self._mean_len) + 1
            for k in rng.integers(0, len(self._pieces), size=need):
                ids.extend(self._pieces[k])
        return ids[:n_tokens]

    def text(self, n_tokens: int, rng: np.random.Generator) -> str:
        if n_tokens <= 0:
            return ""
        return self.tokenizer.decode(self.token_ids(n_tokens, rng)).strip()
