"""Paged attention over scattered blocks equals dense causal attention, on the torch
path and with the native decode kernel."""

import pytest
import torch

from engine.attention import AttentionMetadata, PrefillChunk, build_decode_mask, paged_attention
from engine.config import ConfigError
from engine.cpu_kernels import load_paged_decode, select_decode_kernel

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
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v).reshape(n, -1)


@pytest.fixture(params=["torch", "native"])
def decode_kernel(request):
    if request.param == "torch":
        return None
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("no C++ toolchain here to build the native kernel")
    return kernel


def test_mixed_step_matches_dense(decode_kernel):
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
        torch.tensor([10, 15]),
        decode_kernel,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [D, 64, 128])  # the kernel specialises 64 and 128
# Fewer than 2 sequences per thread: tasks split by KV head; else one task per sequence.
@pytest.mark.parametrize("threads,seqs", [(2, 3), (1, 5)])
def test_native_decode_matches_fp64(dtype, head_dim, threads, seqs):
    """The kernel reads the strided per-layer view of the real pool layout, with rows of
    q strided as in the fused QKV projection, over contexts that end mid-block."""
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("no C++ toolchain here to build the native kernel")
    g = torch.Generator().manual_seed(1)
    layers = 3
    pool = torch.randn(NB, layers, 2, BS, HKV, head_dim, generator=g).to(dtype)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    lens = torch.tensor([1, 4, 5, 13, 32])[-seqs:]
    width = 8  # blocks per table row, padded
    tables = torch.randperm(NB, generator=g)[: seqs * width].view(seqs, width)
    qkv = torch.randn(seqs, H + 2 * HKV, head_dim, generator=g).to(dtype)
    q = qkv[:, :H]
    out = torch.full((seqs, H * head_dim), float("nan"), dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel(q, k_cache, v_cache, tables, lens, out, head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    for i, n in enumerate(lens.tolist()):
        k = k_cache.double()[tables[i]].flatten(0, 1)[:n]
        v = v_cache.double()[tables[i]].flatten(0, 1)[:n]
        expect = dense(q[i : i + 1].double(), k, v, head_dim**-0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i : i + 1].double(), expect, atol=tol, rtol=tol)


def test_native_decode_refuses_reads_outside_the_pool():
    """A raw-pointer kernel must raise, as the torch path's indexing does, never read
    outside the pool."""
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("no C++ toolchain here to build the native kernel")
    k_cache = torch.zeros(NB, BS, HKV, D)
    q = torch.zeros(1, H, D)
    out = torch.empty(1, H * D)
    table = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="context length"):
        kernel(q, k_cache, k_cache, table, torch.tensor([2 * BS + 1]), out, 1.0)
    with pytest.raises(RuntimeError, match="block id"):
        kernel(q, k_cache, k_cache, torch.tensor([[0, NB]]), torch.tensor([BS + 1]), out, 1.0)
    kernel(q, k_cache, k_cache, torch.tensor([[0, NB]]), torch.tensor([BS]), out, 1.0)  # the padding is never read


def test_decode_kernel_choice():
    assert select_decode_kernel("torch", "cpu") is None
    assert select_decode_kernel("auto", "cuda") is None
    with pytest.raises(ConfigError, match="decode_attention"):
        select_decode_kernel("native", "cuda")
