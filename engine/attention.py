"""Attention over the paged KV cache for one mixed step.

A step's tokens are laid out flat: first one token per decoding sequence, then the
prefill chunks. Decode tokens are attended either by the native kernel
(engine/csrc/paged_decode.cpp), which reads each cached row where it lies, or by
one batched gather over their block tables and two matmuls; each prefill chunk
attends causally to its cached prefix plus itself.

KV layout (shared with kvtransfer/ and the LMCache tier): one tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a block is one
contiguous region, so a handoff moves whole blocks with one descriptor each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int  # offset of the chunk in the flat step
    num_tokens: int
    num_computed: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks_needed] long


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [T] block id each new token is written to
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long, padded with 0
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks*block_size] additive (0 / -inf); torch path
    prefills: list[PrefillChunk]
    decode_context_lens: torch.Tensor | None = None  # [D] long, the new token included; native path
    # engine.cpu_kernels' op; None: the torch path (gather, then matmuls).
    decode_kernel: Callable | None = None


def build_decode_mask(context_lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    pos = torch.arange(max_len, device=context_lens.device)
    mask = torch.zeros(context_lens.shape[0], max_len, dtype=dtype, device=context_lens.device)
    mask.masked_fill_(pos[None, :] >= context_lens[:, None], float("-inf"))
    return mask[:, None, None, :]


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim] (new tokens)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] (a view)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into their slots, then attend. Returns [T, num_heads * head_dim]."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    d = meta.num_decode_tokens
    if d and meta.decode_kernel is not None:
        meta.decode_kernel(q[:d], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, out[:d], scale)
    elif d:
        out[:d] = _decode_attention(q[:d], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_start + chunk.num_tokens
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale)
    return out


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # [D, max_blocks, block_size, Hkv, Dh] -> [D, Hkv, L, Dh]
    keys = k_cache[meta.decode_block_tables].flatten(1, 2).permute(0, 2, 3, 1)  # [D, Hkv, Dh, L]
    values = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)  # [D, Hkv, L, Dh]
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)
    assert meta.decode_mask is not None  # built for every step that has decode rows
    scores = torch.matmul(qg, keys).float() * scale + meta.decode_mask  # [D, Hkv, G, L]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(num_seqs, num_heads * head_dim)


def _prefill_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    n = chunk.num_tokens
    if chunk.num_computed == 0:
        keys, values, mask, causal = k, v, None, True
    else:
        context = chunk.num_computed + n
        keys = k_cache[chunk.block_table].flatten(0, 1)[:context]
        values = v_cache[chunk.block_table].flatten(0, 1)[:context]
        key_pos = torch.arange(context, device=q.device)
        query_pos = chunk.num_computed + torch.arange(n, device=q.device)
        mask, causal = key_pos[None, :] <= query_pos[:, None], False
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).reshape(n, -1)
