"""Tenant-isolated KV: a request's cache salt roots its block hash chain, so its KV is
found under its own salt only: in the pool's prefix cache (prompt and imported KV),
in the external tier, and in the prefill router's view of the prefix index; the
gateway derives the salt from the caller's key under `cache_isolation: per_key`."""

from __future__ import annotations

import pytest
from test_external_kv import FakeTier, prompt

from engine.hashing import ROOT_HASH, block_hashes, chain_root, salt_tag
from engine.sampling_params import SamplingParams
from routing.openai.access import cache_salt

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=4, temperature=0)
FP = "model|float32"


def test_salted_chains_share_no_block_and_the_same_salt_always_does():
    ids = list(range(500, 564))  # 4 blocks of 16
    plain = block_hashes(ids, 16, FP)
    a, a_again, b = (block_hashes(ids, 16, FP, s) for s in ("tenant-a", "tenant-a", "tenant-b"))
    assert a == a_again
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)
    assert block_hashes(ids, 16, FP, "") == block_hashes(ids, 16, FP, None) == plain
    assert chain_root(None) == ROOT_HASH != chain_root("tenant-a")
    assert salt_tag("tenant-a") != salt_tag("tenant-b") and "tenant" not in salt_tag("tenant-a")


def run(engine, ids, salt: str | None, imported: bool = False):
    """One greedy request to its end; the final output. `imported`: it joins as a
    decode replica's request whose KV import failed (recomputed, then cached)."""
    if imported:
        rid = f"imp-{salt}-{len(engine.scheduler.requests)}"
        engine.add_imported_request(rid, ids, ids[-1], GREEDY, None, cache_salt=salt)
    else:
        rid = engine.add_request(ids, GREEDY, cache_salt=salt)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_the_pool_hits_under_the_same_salt_only(make_engine):
    e = make_engine()
    ids = prompt(80, seed=11)
    assert run(e, ids, "tenant-a").num_cached_tokens == 0
    assert run(e, ids, "tenant-a").num_cached_tokens == 64  # 4 of 5 blocks (the last token is computed)
    assert run(e, ids, "tenant-b").num_cached_tokens == 0
    assert run(e, ids, None).num_cached_tokens == 0
    assert run(e, ids, "tenant-b").num_cached_tokens == 64


def test_imported_blocks_are_cached_under_the_requests_salt(make_engine):
    e = make_engine(role="decode")
    ids = prompt(80, seed=12)
    run(e, ids, "tenant-a", imported=True)
    assert run(e, ids, "tenant-b").num_cached_tokens == 0
    assert run(e, ids, "tenant-a").num_cached_tokens == 64


def test_the_external_tier_is_read_and_written_under_the_salt(make_engine):
    ids = prompt(100, seed=13)
    chunks: dict = {}
    writer = make_engine()
    writer.attach_external_kv(FakeTier(writer.kv_cache.data, chunks, 16))
    run(writer, ids, "tenant-a")
    assert {salt for salt, _ in chunks} == {"tenant-a"}
    reader = make_engine()  # another replica: empty pool, the same tier
    tier = FakeTier(reader.kv_cache.data, chunks, 16)
    reader.attach_external_kv(tier)
    assert run(reader, ids, "tenant-b").num_cached_tokens == 0
    assert tier.loads == []
    assert run(make_engine_with(make_engine, chunks), ids, "tenant-a").num_cached_tokens == 96


def make_engine_with(make_engine, chunks: dict):
    e = make_engine()
    e.attach_external_kv(FakeTier(e.kv_cache.data, chunks, 16))
    return e


def test_the_gateway_salt_puts_the_key_first():
    assert cache_salt("none", "k1", None) is None
    assert cache_salt("none", "k1", "s") == cache_salt("none", "k2", "s")  # the client's own salt only
    assert cache_salt("per_key", "k1", None) != cache_salt("per_key", "k2", None)
    assert cache_salt("per_key", "k1", "s") != cache_salt("per_key", "k2", "s")
    assert cache_salt("per_key", "k1", "s") != cache_salt("per_key", "k1", None)
    # No requested salt reaches another key's namespace, or the unsalted one.
    assert cache_salt("none", "k1", "key=k2;salt=") != cache_salt("per_key", "k2", None)
    assert cache_salt("per_key", "k1", "x;key=k2") != cache_salt("per_key", "k2", "x")
