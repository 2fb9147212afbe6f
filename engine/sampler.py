"""Batched sampling on the engine's device.

Rows that ask for them get penalties, logit biases and their grammar's mask first. Greedy rows then take
the argmax; the others apply temperature, top-k and top-p, then draw with the
exponential race (argmax of p / Exp(1)), which needs one
random tensor per step and lets a seeded request draw from its own generator.
Logprobs are those of the model's raw distribution (before temperature), as in
vLLM and the OpenAI API.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request, TokenLogprob
from engine.structured import GrammarMatcher, apply_bitmask


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """OpenAI presence/frequency penalties on output tokens; HF-style repetition
    penalty on prompt and output tokens. In place, only on rows that ask for them."""
    vocab = logits.shape[1]
    for i, req in enumerate(reqs):
        sp = req.sampling
        if not sp.needs_penalties:
            continue
        row = logits[i]
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=logits.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        out = req.output_token_ids
        if out and (sp.presence_penalty or sp.frequency_penalty):
            counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=vocab)[:vocab].to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)


def apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    """OpenAI's logit_bias, in place, only on rows that ask for it."""
    for i, req in enumerate(reqs):
        bias = req.sampling.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))


def apply_grammars(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Structured outputs, in place: each grammar row keeps only the tokens its grammar
    allows next (one bitmask for those rows, filled on llguidance's threads)."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    GrammarMatcher.fill_bitmasks([reqs[i].grammar for i in rows], bitmask)  # type: ignore[misc]
    if len(rows) == len(reqs):
        apply_bitmask(logits, bitmask)
        return
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index)
    apply_bitmask(masked, bitmask)
    logits.index_copy_(0, index, masked)


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus. `top_k` <= 0 and
    `top_p` == 1 disable the respective filter for that row."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    remove = ranks >= k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # Keep a token if the mass strictly before it is < top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    mask = torch.zeros_like(remove).scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        device = logits.device
        want_logprobs = [r.sampling.logprobs is not None for r in reqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if any(r.sampling.needs_penalties or r.sampling.logit_bias or r.grammar is not None for r in reqs):
            logits = logits.clone()
            apply_penalties(logits, reqs)
            apply_logit_bias(logits, reqs)
            apply_grammars(logits, reqs)

        greedy = torch.tensor([r.sampling.greedy for r in reqs], device=device)
        chosen = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temps = torch.tensor([r.sampling.temperature or 1.0 for r in reqs], device=device)
            top_k = torch.tensor([r.sampling.top_k for r in reqs], device=device)
            top_p = torch.tensor([float(r.sampling.top_p) for r in reqs], device=device)
            scaled = logits / temps[:, None]
            if bool((top_k > 0).any()) or bool((top_p < 1).any()):
                scaled = top_k_top_p_mask(scaled, top_k, top_p)
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for i, req in enumerate(reqs):
                if req.generator is not None and not req.sampling.greedy:
                    noise[i].exponential_(generator=req.generator)
            sampled = (probs / noise).argmax(dim=-1)
            chosen = torch.where(greedy, chosen, sampled)

        token_ids = chosen.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for i, req in enumerate(reqs):
                n = req.sampling.logprobs
                if n is None:
                    continue
                tok = token_ids[i]
                top: tuple[tuple[int, float], ...] = ()
                if n > 0:
                    vals, idx = raw_logprobs[i].topk(n)
                    top = tuple(zip(idx.tolist(), vals.tolist()))
                logprobs[i] = TokenLogprob(tok, float(raw_logprobs[i, tok]), top)
        return SamplerOutput(token_ids, logprobs)
