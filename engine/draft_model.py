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

Drafting runs per request, batch 1, inside the scheduler's pass: speculation runs
only while at most `max_batch_size` requests decode, where a step is bound by reading
the weights and a small model's forwards are cheap next to the target's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, PrefillChunk, build_decode_mask
from engine.config import ConfigError
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.quant import packs_weights
from engine.request import Request
from engine.speculative import Proposer, SpeculativeConfig
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

    @classmethod
    def load(cls, cfg: SpeculativeConfig, max_model_len: int, block_size: int, target: LlamaModel,
             target_checkpoint: Checkpoint, packed_weights: str,
             decode_kernel: Callable | None = None) -> DraftModelProposer:
        """The draft checkpoint in the target's dtype and device; the target's own weights
        when it names the same checkpoint (then drafting costs what the target does)."""
        assert cfg.draft_model is not None  # the config's validator
        ckpt = resolve_checkpoint(cfg.draft_model)
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

    def _draft(self, req: Request, k: int) -> list[int]:
        tokens = req.token_ids
        n = len(tokens)
        if n + k - 1 > self.model.cfg.max_position_embeddings:
            return []
        seq = self._seqs.pop(req.request_id, None) or _DraftSequence()
        self._seqs[req.request_id] = seq  # now the most recent
        # The draft KV holds the request's tokens up to `seen` and then the previous
        # drafts: keep what the verification accepted, and at least the pending token to run.
        keep = seq.seen
        limit = min(len(seq.token_ids), n - 1)
        while keep < limit and seq.token_ids[keep] == tokens[keep]:
            keep += 1
        keep = min(keep, n - 1)
        if not self._reserve(req.request_id, seq, n + k - 1):
            self.forget(req.request_id)
            return []
        drafts = [self._next_token(seq, tokens[keep:], keep)]
        for i in range(1, k):
            drafts.append(self._next_token(seq, drafts[-1:], n + i - 1))
        seq.token_ids = [*tokens, *drafts[:-1]]
        seq.seen = n
        return drafts

    def _reserve(self, request_id: str, seq: _DraftSequence, num_tokens: int) -> bool:
        """Pages for `num_tokens` of `seq`, taken from the least recently drafting
        requests if the pool is short; False when even that is not enough."""
        total = -(-num_tokens // self.block_size)
        if total > self.kv_cache.num_blocks:  # longer than the whole pool: evict nobody for it
            return False
        need = total - len(seq.blocks)
        while need > len(self._free):
            oldest = next(iter(self._seqs))
            if oldest == request_id:  # only this request holds pages, and they are too few
                return False
            self.forget(oldest)
            self.num_evictions += 1
        for _ in range(need):
            seq.blocks.append(self._free.pop())
        return True

    def _next_token(self, seq: _DraftSequence, ids: list[int], start: int) -> int:
        """Write the KV of `ids` at positions `start`.. and return the draft model's
        greedy token after the last of them."""
        n, bs, dev = len(ids), self.block_size, self.model.device
        table = torch.tensor(seq.blocks[: -(-(start + n) // bs)], dtype=torch.long, device=dev)
        positions = torch.arange(start, start + n, device=dev)
        slots = table[positions // bs], positions % bs
        if n == 1:  # one row: a decode's attention (the native kernel where the engine has it)
            lens = torch.tensor([start + 1], dtype=torch.long, device=dev)
            mask = build_decode_mask(lens, len(table) * bs, torch.float32) if self.decode_kernel is None else None
            meta = AttentionMetadata(*slots, 1, table[None, :], mask, [], lens, self.decode_kernel)
        else:
            meta = AttentionMetadata(*slots, 0, None, None, [PrefillChunk(0, n, start, table)])
        last = torch.tensor([n - 1], dtype=torch.long, device=dev)
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev), positions, meta,
                                    self.kv_cache.layers, last)
        return int(logits[0].argmax())

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)
