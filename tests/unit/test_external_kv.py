"""The engine's external KV hook (engine/external_kv.py) with a fake tier: a hit
loads KV into fresh blocks and gives the same greedy tokens as a miss. A cache named by
an `ExternalKVSpec` is built around the engine's KV by whoever runs the engine, which
owns it: its counters, and its close (also when the engine refuses it)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.async_engine import AsyncEngine, attach_external_kv
from engine.external_kv import ExternalKVCache, ExternalKVSpec
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

CHUNK = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0)


class FakeTier:
    """Chunks keyed by their salt and token prefix; shared `chunks` dict = a shared tier."""

    chunk_size = CHUNK

    def __init__(self, kv: torch.Tensor, chunks: dict, block_size: int, fail_load: bool = False):
        self.kv, self.chunks, self.bs, self.fail_load = kv, chunks, block_size, fail_load
        self.loads: list[tuple[int, int]] = []
        self.stores = 0

    def lookup(self, token_ids, cache_salt=None) -> int:
        n = 0
        while n + CHUNK <= len(token_ids) and (cache_salt, tuple(token_ids[: n + CHUNK])) in self.chunks:
            n += CHUNK
        return n

    def _blocks(self, block_ids, start, end):
        return torch.tensor(block_ids[start // self.bs : end // self.bs])

    def load(self, token_ids, block_ids, start, end, cache_salt=None) -> int:
        self.loads.append((start, end))
        if self.fail_load:
            return start
        for s in range(start, end, CHUNK):
            self.kv[self._blocks(block_ids, s, s + CHUNK)] = self.chunks[(cache_salt, tuple(token_ids[: s + CHUNK]))]
        return end

    def store(self, token_ids, block_ids, num_tokens, cache_salt=None) -> None:
        self.stores += 1
        for s in range(0, num_tokens - num_tokens % CHUNK, CHUNK):
            self.chunks.setdefault((cache_salt, tuple(token_ids[: s + CHUNK])),
                                   self.kv[self._blocks(block_ids, s, s + CHUNK)].clone())


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def run(engine, ids):
    return engine.generate([ids], GREEDY)[0]


def test_fake_tier_satisfies_protocol(make_engine):
    e = make_engine()
    assert isinstance(FakeTier(e.kv_cache.data, {}, 16), ExternalKVCache)


def test_hit_on_a_fresh_engine_is_exact(make_engine):
    ids = prompt(100)
    miss = run(make_engine(), ids)
    chunks: dict = {}
    a = make_engine()
    a.attach_external_kv(FakeTier(a.kv_cache.data, chunks, 16))
    assert run(a, ids).token_ids == miss.token_ids
    assert len(chunks) == 3  # 100 prompt tokens → 3 full chunks stored once the prompt is done

    b = make_engine()  # another replica: empty pool, same tier
    tier_b = FakeTier(b.kv_cache.data, chunks, 16)
    b.attach_external_kv(tier_b)
    hit = run(b, ids)
    assert hit.token_ids == miss.token_ids
    assert hit.num_cached_tokens == 96
    assert tier_b.loads == [(0, 96)]
    s = b.stats()
    assert s.external_kv_hit_tokens == 96 and s.external_kv_loaded_tokens == 96


def test_lookup_leaves_the_last_token_to_compute(make_engine):
    ids = prompt(96, seed=1)  # exactly 3 chunks: the last one must not be loaded
    chunks: dict = {}
    a = make_engine()
    a.attach_external_kv(FakeTier(a.kv_cache.data, chunks, 16))
    miss = run(a, ids)
    b = make_engine()
    tier_b = FakeTier(b.kv_cache.data, chunks, 16)
    b.attach_external_kv(tier_b)
    hit = run(b, ids)
    assert tier_b.loads == [(0, 64)]
    assert hit.token_ids == miss.token_ids and hit.num_cached_tokens == 64


def test_pool_hit_is_cut_back_to_a_chunk_boundary(make_engine):
    shared = prompt(48, seed=2)  # 3 blocks = 1.5 chunks in the pool
    long = shared + prompt(60, seed=3)
    miss = run(make_engine(), long)
    chunks: dict = {}
    a = make_engine()
    a.attach_external_kv(FakeTier(a.kv_cache.data, chunks, 16))
    run(a, long)  # the tier now holds 3 chunks of `long`
    b = make_engine()
    tier_b = FakeTier(b.kv_cache.data, {}, 16)
    b.attach_external_kv(tier_b)
    run(b, shared)  # b's pool: the 3 blocks of the shared prefix (48 tokens)
    tier_b.chunks = chunks
    hit = run(b, long)
    # The pool held 48 tokens (1.5 chunks): the tier loads from the chunk boundary at
    # 32 into fresh blocks, never over the pool's shared blocks.
    assert tier_b.loads == [(32, 96)]
    assert hit.token_ids == miss.token_ids
    assert hit.num_cached_tokens == 96
    assert b.stats().external_kv_hit_tokens == 48  # beyond the pool's own hit


def test_failed_load_computes_instead(make_engine):
    ids = prompt(100, seed=4)
    chunks: dict = {}
    a = make_engine()
    a.attach_external_kv(FakeTier(a.kv_cache.data, chunks, 16))
    miss = run(a, ids)
    b = make_engine()
    b.attach_external_kv(FakeTier(b.kv_cache.data, chunks, 16, fail_load=True))
    out = run(b, ids)
    assert out.token_ids == miss.token_ids and out.num_cached_tokens == 0
    s = b.stats()
    assert s.external_kv_load_failures == 1 and s.external_kv_hit_tokens == 0


def test_prefill_role_stores_before_export(make_engine):
    ids = prompt(70, seed=5)
    chunks: dict = {}
    e = make_engine(role="prefill")
    tier = FakeTier(e.kv_cache.data, chunks, 16)
    e.attach_external_kv(tier)
    rid = e.add_request(ids, GREEDY)
    while e.has_unfinished():
        e.step()
    export = e.take_export(rid)
    assert export is not None and tier.stores == 1 and len(chunks) == 2
    e.release_blocks(export.block_ids)


def test_chunk_size_must_be_a_multiple_of_block_size(make_engine):
    e = make_engine()
    bad = FakeTier(e.kv_cache.data, {}, 16)
    bad.chunk_size = 24
    with pytest.raises(ValueError, match="chunk_size"):
        e.attach_external_kv(bad)


class SourcedTier(FakeTier):
    """Says where its last load came from, as the LMCache tier does."""

    def load(self, token_ids, block_ids, start, end, cache_salt=None) -> int:
        got = super().load(token_ids, block_ids, start, end)
        self.last_load_sources = {"cpu": got - start}
        return got


@pytest.mark.parametrize("tier_cls, source", [(SourcedTier, "cpu"), (FakeTier, "external")])
def test_a_request_reports_its_cached_tokens_by_source(make_engine, tier_cls, source):
    shared = prompt(48, seed=2)
    long = shared + prompt(60, seed=3)
    chunks: dict = {}
    a = make_engine()
    a.attach_external_kv(FakeTier(a.kv_cache.data, chunks, 16))
    run(a, long)
    b = make_engine()
    tier_b = tier_cls(b.kv_cache.data, {}, 16)
    b.attach_external_kv(tier_b)
    run(b, shared)
    tier_b.chunks = chunks
    final = list(b.stream(long, GREEDY))[-1]
    m = final.metrics
    # 32 tokens from the pool (cut back to the chunk boundary), 64 loaded from the tier
    assert m.cached_tokens_by_source == {"pool": 32, source: 64}
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.queue_s >= 0 and m.num_preemptions == 0


def test_a_failed_load_attributes_no_tokens_to_an_earlier_loads_sources(make_engine):
    shared = prompt(64, seed=4)
    chunks: dict = {}
    a = make_engine()
    a.attach_external_kv(FakeTier(a.kv_cache.data, chunks, 16))
    run(a, shared)
    b = make_engine()
    class Raising(SourcedTier):
        def load(self, *args):
            raise OSError("tier read failed")

    tier_b = Raising(b.kv_cache.data, chunks, 16)
    tier_b.last_load_sources = {"cpu": 64}  # left over from an earlier load
    b.attach_external_kv(tier_b)
    final = list(b.stream(shared, GREEDY))[-1]
    assert final.metrics.cached_tokens_by_source == {}



class OwnedTier(FakeTier):
    """A `ManagedExternalKV`: counters and a close, as the LMCache tier has."""

    closed = False

    def as_dict(self) -> dict:
        return {"fake_stores": self.stores}

    def close(self) -> None:
        self.closed = True


BUILT: list[OwnedTier] = []


def make_owned_tier(config: dict, kv: torch.Tensor, model_fingerprint: str) -> OwnedTier:
    """The factory an `ExternalKVSpec` names (this module, by its import name)."""
    tier = OwnedTier(kv, {}, 16)
    tier.chunk_size = config["chunk_size"]
    BUILT.append(tier)
    return tier


def test_the_engine_thread_builds_owns_and_closes_the_cache_its_spec_names(make_engine):
    e = make_engine(role="prefill")
    aengine = AsyncEngine(e)
    try:
        spec = ExternalKVSpec(f"{__name__}:make_owned_tier", {"chunk_size": CHUNK})
        tier = aengine.external_kv = aengine.submit(lambda: attach_external_kv(e, spec)).result(30)
        assert isinstance(tier, OwnedTier) and tier.kv is e.kv_cache.data  # built around the engine's KV
        assert aengine.external_kv_stats == {"fake_stores": 0}

        async def prefill() -> None:
            outs = [o async for batch in await aengine.add_request("r", prompt(70, seed=6), GREEDY) for o in batch]
            assert outs[-1].finished

        asyncio.run(prefill())
        assert aengine.external_kv_stats == {"fake_stores": 1}  # stored as its prefill completed
    finally:
        aengine.shutdown()
    assert tier.closed


def test_a_cache_the_engine_refuses_is_closed_again(make_engine):
    BUILT.clear()
    spec = ExternalKVSpec(f"{__name__}:make_owned_tier", {"chunk_size": 24})  # not whole 16-token blocks
    with pytest.raises(ValueError, match="chunk_size 24"):
        attach_external_kv(make_engine(), spec)
    (tier,) = BUILT
    assert tier.closed
