"""Paged attention over scattered blocks equals dense causal attention."""

import pytest
import torch

from engine.attention import AttentionMetadata, PrefillChunk, build_decode_mask, paged_attention

pytestmark = pytest.mark.unit

H, HKV, D, BS, NB = 6, 2, 16, 4, 64


def dense(q, k, v, scale):
    # q [n, H, D], k/v [L, HKV, D]; causal with the queries at the end of the context.
    n, L = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    qpos = torch.arange(L - n, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v).reshape(n, H * D)


def test_mixed_step_matches_dense():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(NB, BS, HKV, D)
    v_cache = torch.zeros(NB, BS, HKV, D)
    scale = D**-0.5
    # Two decoding sequences with 9 and 14 cached tokens, one prefill chunk of 7 tokens
    # after 5 cached ones; every sequence's blocks are scattered over the pool.
    perm = torch.randperm(NB, generator=g)
    tables = [perm[0:3], perm[3:7], perm[7:10]]
    ctx = [9, 14, 5]
    full_k, full_v = [], []
    for t, c in zip(tables, ctx):
        k = torch.randn(c + (7 if c == 5 else 1), HKV, D, generator=g)
        v = torch.randn_like(k)
        full_k.append(k)
        full_v.append(v)
        for p in range(c):  # the cached part
            k_cache[t[p // BS], p % BS] = k[p]
            v_cache[t[p // BS], p % BS] = v[p]
    new_pos = [[9], [14], list(range(5, 12))]
    q = torch.randn(9, H, D, generator=g)
    k_new = torch.cat([full_k[0][9:], full_k[1][14:], full_k[2][5:]])
    v_new = torch.cat([full_v[0][9:], full_v[1][14:], full_v[2][5:]])
    slot_blocks = torch.tensor([int(tables[i][p // BS]) for i in range(3) for p in new_pos[i]])
    slot_offsets = torch.tensor([p % BS for i in range(3) for p in new_pos[i]])
    dec_tables = torch.stack([torch.cat([tables[0], tables[0][:1]]), tables[1]])  # padded
    meta = AttentionMetadata(
        slot_blocks,
        slot_offsets,
        2,
        dec_tables,
        build_decode_mask(torch.tensor([10, 15]), 4 * BS, torch.float32),
        [PrefillChunk(2, 7, 5, tables[2])],
    )
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale)
    expect = torch.cat(
        [
            dense(q[0:1], full_k[0], full_v[0], scale),
            dense(q[1:2], full_k[1], full_v[1], scale),
            dense(q[2:9], full_k[2], full_v[2], scale),
        ]
    )
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
