"""Draft-model speculative decoding: a smaller checkpoint drafts, the engine verifies.

`DraftModelProposer` runs the draft model greedily for `num_tokens` tokens past a
decoding request's pending token; the engine then scores them all in one forward of
the target (engine/speculative.py). The draft is a point mass (its argmax), so the
verification's rule keeps outputs exact: greedy outputs equal no speculation, and
sampled ones keep the target's distribution. A draft's quality moves only the
acceptance rate, never an output; that is why the draft's KV may lag or be dropped.

The draft model keeps its own paged KV cache (`speculative.draft_kv_tokens`), with
each drafting request's pages and the tokens they hold. Before drafting, it runs the
tokens it has not seen (the whole prompt the first time, then the tokens verified
since its last draft) as one chunk; each further draft token is one more forward of
one row. The rejected drafts' KV is overwritten by the next catch-up. A request whose
prompt KV arrived from a prefill replica is drafted the same way: the draft model
prefills it on its first draft, here. When the pool is short, the request that
drafted least recently gives its pages up (it catches up again if it drafts again).

Drafting runs inside the scheduler's pass, for a step's drafting requests together:
one forward of the draft model runs every request's catch-up, then one forward per
further draft position runs a decode row for each (`num_tokens` forwards a step,
whatever the batch). Speculation runs only while at most `max_batch_size` requests
decode, where a step is bound by reading the weights and a small model's forwards
are cheap next to the target's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import ConfigError, SpeculativeConfig
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.model_runner import batch_inputs
from engine.quant import packs_weights
from engine.request import Request
from engine.speculative import Proposer
from engine.weights import Checkpoint, load_checkpoint, resolve_checkpoint


@dataclass
class _DraftSequence:
    """One request's pages in the draft model's KV cache and the tokens they hold."""

    blocks: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the draft KV's tokens, position by position
    seen: int = 0  # the request's length at the last draft: token_ids agrees with it up to here


class DraftModelProposer(Proposer):
    """Drafts with a smaller model of the same vocabulary, on its own KV cache."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, model: LlamaModel, block_size: int,
                 decode_kernel: Callable | None = None) -> None:
        super().__init__(cfg, max_model_len)
        self.model = model
        self.block_size = block_size
        self.decode_kernel = decode_kernel  # the engine's: one-row forwards attend as a decode does
        num_blocks = -(-cfg.draft_kv_tokens // block_size)
        self.kv_cache = KVCache(model.cfg, num_blocks, block_size, model.dtype, model.device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: OrderedDict[str, _DraftSequence] = OrderedDict()  # the least recently drafting first
        self.num_evictions = 0  # requests whose draft KV made room for another's
        self.num_forwards = 0  # the draft model's forwards: one per draft position per step, whatever the batch

    @classmethod
    def load(cls, cfg: SpeculativeConfig, max_model_len: int, block_size: int, target: LlamaModel,
             target_checkpoint: Checkpoint, packed_weights: str,
             decode_kernel: Callable | None = None) -> DraftModelProposer:
        """The draft checkpoint in the target's dtype and device; the target's own weights
        when it names the same checkpoint (then drafting costs what the target does)."""
        assert cfg.draft_model is not None  # the config's validator
        ckpt = resolve_checkpoint(cfg.draft_model, field="speculative.draft_model")
        if ckpt.path.resolve() == target_checkpoint.path.resolve():
            model = target
        else:
            model_cfg, state = load_checkpoint(ckpt, target.dtype)
            packed = packs_weights(packed_weights, target.device, target.dtype, "none")
            model = LlamaModel(model_cfg, state, target.dtype, target.device, "none", packed)
        if model.cfg.vocab_size != target.cfg.vocab_size:
            raise ConfigError("speculative.draft_model",
                              f"{ckpt.model_id} has {model.cfg.vocab_size} tokens, the target "
                              f"{target.cfg.vocab_size}: a draft model must share the target's vocabulary")
        return cls(cfg, max_model_len, model, block_size, decode_kernel)

    def _draft_all(self, todo: list[tuple[Request, int]]) -> list[list[int]]:
        """Draft for every (request, k) at once: one forward runs each request's
        catch-up, then one forward per further draft position runs one row for each
        request that drafts that far."""
        out: list[list[int]] = [[] for _ in todo]
        plans: list[tuple[int, _DraftSequence, list[int], int, int]] = []  # (index, sequence, tokens, kept, k)
        drafting = {req.request_id for req, _ in todo}  # none of them gives its pages up to another
        for i, (req, k) in enumerate(todo):
            tokens = req.token_ids
            if len(tokens) + k - 1 > self.model.cfg.max_position_embeddings:
                continue
            seq = self._seqs.pop(req.request_id, None) or _DraftSequence()
            self._seqs[req.request_id] = seq  # now the most recent
            if not self._reserve(seq, len(tokens) + k - 1, drafting):
                self.forget(req.request_id)
                continue
            plans.append((i, seq, tokens, self._kept(seq, tokens), k))
        if not plans:
            return out
        # Each request's draft KV holds its tokens up to what it kept: run the rest.
        runs = [[t] for t in self._forward([(seq, tokens[kept:], kept) for _, seq, tokens, kept, _ in plans])]
        for step in range(1, max(k for *_, k in plans)):
            rows = [j for j, plan in enumerate(plans) if plan[4] > step]
            nexts = self._forward([(plans[j][1], runs[j][-1:], len(plans[j][2]) + step - 1) for j in rows])
            for j, t in zip(rows, nexts):
                runs[j].append(t)
        for (i, seq, tokens, _, _), run in zip(plans, runs):
            seq.token_ids = [*tokens, *run[:-1]]
            seq.seen = len(tokens)
            out[i] = run
        return out

    @staticmethod
    def _kept(seq: _DraftSequence, tokens: list[int]) -> int:
        """How many leading positions of `seq`'s draft KV hold `tokens`: what the
        verification accepted of the last drafts, and never the pending token (it runs)."""
        keep = seq.seen
        limit = min(len(seq.token_ids), len(tokens) - 1)
        while keep < limit and seq.token_ids[keep] == tokens[keep]:
            keep += 1
        return min(keep, len(tokens) - 1)

    def _reserve(self, seq: _DraftSequence, num_tokens: int, keep: set[str]) -> bool:
        """Pages for `num_tokens` of `seq`, taken from the least recently drafting
        requests not in `keep` if the pool is short; False when that is not enough."""
        total = -(-num_tokens // self.block_size)
        if total > self.kv_cache.num_blocks:  # longer than the whole pool: evict nobody for it
            return False
        need = total - len(seq.blocks)
        while need > len(self._free):
            victim = next((rid for rid in self._seqs if rid not in keep), None)
            if victim is None:  # only this step's drafting requests hold pages
                return False
            self.forget(victim)
            self.num_evictions += 1
        for _ in range(need):
            seq.blocks.append(self._free.pop())
        return True

    def _forward(self, items: list[tuple[_DraftSequence, list[int], int]]) -> list[int]:
        """One forward of the draft model: for each (sequence, token ids, first
        position), write the ids' KV from that position on and return the greedy token
        after the last of them. One-id items run as decode rows (the engine's kernel),
        the rest as prefill chunks."""
        bs, dev = self.block_size, self.model.device
        self.num_forwards += 1
        # Decode rows first, then the chunks: the layout attention expects.
        order = sorted(range(len(items)), key=lambda i: len(items[i][1]) > 1)
        rows = [(toks, start, seq.blocks[: -(-(start + len(toks)) // bs)])
                for seq, toks, start in (items[i] for i in order)]
        d = sum(len(toks) == 1 for toks, _, _ in rows)
        ids, positions, meta = batch_inputs(rows, d, bs, dev, self.decode_kernel)
        last = [*range(d), *(c.token_start + c.num_tokens - 1 for c in meta.prefills)]
        logits = self.model.forward(ids, positions, meta, self.kv_cache.layers,
                                    torch.tensor(last, dtype=torch.long, device=dev))
        out = [0] * len(items)
        for i, t in zip(order, logits.argmax(dim=-1).tolist()):
            out[i] = t
        return out

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)
