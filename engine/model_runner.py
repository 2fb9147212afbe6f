"""Turns one scheduled batch into logits: input tensors, slot mapping, attention
metadata, the forward pass over the paged KV cache.

The `Engine` decides *what* runs (scheduler) and what happens to the sampled
tokens; the `ModelRunner` owns *how* a batch becomes tensors on the device. Rows
are laid out decodes first (one token each), then prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.attention import AttentionMetadata, PrefillChunk, build_decode_mask
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.scheduler import SchedulerOutput

# One sequence's rows of a step: its new token ids, the position of the first, and its
# block table up to the block the last one lands in.
BatchRow = tuple[Sequence[int], int, Sequence[int]]


def batch_inputs(rows: Sequence[BatchRow], num_decodes: int, block_size: int, device: str,
                 decode_kernel: Callable | None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, attention metadata) of one forward over the paged KV
    cache: the first `num_decodes` rows are one-token decodes, the rest prefill chunks."""
    bs, dev = block_size, device
    ids: list[int] = []
    pos: list[int] = []
    decode_tables: list[Sequence[int]] = []
    context_lens: list[int] = []
    for toks, p, table in rows[:num_decodes]:
        ids.append(toks[0])
        pos.append(p)
        decode_tables.append(table)
        context_lens.append(p + 1)
    chunks: list[PrefillChunk] = []
    start = len(ids)
    for toks, c, table in rows[num_decodes:]:
        n = len(toks)
        ids.extend(toks)
        pos.extend(range(c, c + n))
        chunks.append(PrefillChunk(start, n, c, torch.tensor(table, dtype=torch.long, device=dev)))
        start += n
    input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
    positions = torch.tensor(pos, dtype=torch.long, device=dev)

    # Slot of every new token: decode rows from their tables, prefill rows by chunk.
    slot_blocks = torch.empty_like(positions)
    d = num_decodes
    if d:
        slot_blocks[:d] = torch.tensor([t[-1] for t in decode_tables], dtype=torch.long, device=dev)
    for ch in chunks:
        chunk_pos = positions[ch.token_start : ch.token_start + ch.num_tokens]
        slot_blocks[ch.token_start : ch.token_start + ch.num_tokens] = ch.block_table[chunk_pos // bs]
    slot_offsets = positions % bs

    tables = mask = lens = None
    if d:
        width = max(len(t) for t in decode_tables)
        tables = torch.tensor([[*t, *[0] * (width - len(t))] for t in decode_tables], dtype=torch.long, device=dev)
        lens = torch.tensor(context_lens, dtype=torch.long, device=dev)
        if decode_kernel is None:
            mask = build_decode_mask(lens, width * bs, torch.float32)
    return input_ids, positions, AttentionMetadata(slot_blocks, slot_offsets, d, tables, mask, chunks, lens,
                                                   decode_kernel)


class ModelRunner:
    """Owns the model and the KV cache tensor of one engine."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_size: int,
                 decode_kernel: Callable | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.decode_kernel = decode_kernel  # None: decode attention on the torch path

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Logits ([rows that sample, vocab]) of one scheduled batch; writes its KV."""
        input_ids, positions, meta, logits_idx = self.prepare(sched)
        return self.model.forward(input_ids, positions, meta, self.kv_cache.layers, logits_idx)

    def prepare(self, sched: SchedulerOutput):
        """(input_ids, positions, attention metadata, rows whose logits are sampled)."""
        bs = self.block_size
        rows: list[BatchRow] = []
        for s in sched.decodes:
            r = s.request
            p = r.num_computed_tokens
            rows.append(([r.token_ids[p]], p, r.block_ids[: p // bs + 1]))
        for s in sched.prefills:
            r, n, c = s.request, s.num_new_tokens, s.request.num_computed_tokens
            rows.append((s.input_token_ids, c, r.block_ids[: -(-(c + n) // bs)]))
        input_ids, positions, meta = batch_inputs(rows, len(sched.decodes), bs, self.device, self.decode_kernel)

        logits_idx: list[int] = []
        row = 0
        for s in sched.scheduled:
            row += s.num_new_tokens
            if s.samples:
                logits_idx.extend(range(row - s.num_sampled_rows, row))
        return input_ids, positions, meta, torch.tensor(logits_idx, dtype=torch.long, device=self.device)

    def score(self, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
        """Logits at every position of `token_ids` ([n, vocab]) in one prefill into
        `block_ids` (the caller allocates and frees them), outside the scheduler."""
        n = len(token_ids)
        table = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)
        meta = AttentionMetadata(
            table[positions // self.block_size],
            positions % self.block_size,
            0,
            None,
            None,
            [PrefillChunk(0, n, 0, table)],
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model.forward(ids, positions, meta, self.kv_cache.layers, positions)
