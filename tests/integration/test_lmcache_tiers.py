"""LMCache tiers in the prefill pool, end to end through the gateway (real Ray,
real Redis): a prompt evicted from the block pool, or computed by a replica that
is gone, is served from the CPU, disk or Redis tier with the same greedy tokens
as a miss; Redis down is skipped and counted, and Redis coming back is used again.

Each test asks for its config ("tiers": CPU and Redis; "tiers-disk") and starts from
what it needs itself, in any order: the one that needs a prefill replica whose LMCache
connections never saw a Redis restart starts a new replica first.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("lmcache", reason="LMCache not installed (see scripts/setup.sh)")

from duet_cluster import (  # noqa: E402
    TIERS_CHUNK,
    Duet,
    cached_tokens,
    complete,
    kill_replicas,
    prompt,
    wait_for,
    wait_new_replica,
)

from routing.openai.access import ANONYMOUS, cache_salt  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.cluster("tiers")]

P_LEN = 600  # → 4 whole chunks (512 tokens) in the tiers
HIT = P_LEN // TIERS_CHUNK * TIERS_CHUNK


def _evict(duet: Duet, seed: int) -> None:
    """Two 900-token prompts: together they need every block of the 64-block pool."""
    for i in range(2):
        complete(duet, prompt(900, seed + i), max_tokens=2)


def _tier_ops(stats: dict) -> int:
    """Operations of the replica's tier so far (each one checks Redis first)."""
    return stats["kv_tier_lookups"] + stats["kv_tier_retrieves"] + stats["kv_tier_stores"]


def _wait_tier_holds(duet: Duet, ids: list[int], tier: dict, timeout: float = 30.0,
                     cache_salt: str | None = None) -> None:
    """Wait until a tier (Redis or disk: the replica writes them asynchronously) holds
    the whole chunks of `ids`, read through a `KVTier` of our own with the replicas'
    model fingerprint and KV layout."""
    import torch

    from engine.engine import expected_model_fingerprint
    from prefill.kv_tier.config import KVTierConfig
    from prefill.kv_tier.tier import KVTier

    cfg = KVTierConfig(chunk_size=duet.cfg.cache.chunk_size, namespace=duet.cfg.cache.namespace, **tier)
    kv = torch.zeros(4, 30, 2, duet.cfg.engine.block_size, 3, 64)  # SmolLM2's layout, fp32
    want = len(ids) // cfg.chunk_size * cfg.chunk_size

    def held() -> bool:
        with KVTier(cfg, kv, expected_model_fingerprint(duet.cfg.engine)) as reader:
            return reader.lookup(ids, cache_salt) >= want

    wait_for(held, timeout, what=f"the tier {tier} holding the prompt's chunks")


def _restart_prefill(duet: Duet) -> str:
    """Replace the prefill replica; returns the new one's id once it answers."""
    old = set(kill_replicas("prefill"))
    assert old
    return wait_new_replica(duet, "prefill", old)


def test_cpu_tier_restores_an_evicted_prompt(duet):
    p = prompt(P_LEN, 1)
    start = duet.stats("prefill")
    miss = complete(duet, p)
    assert cached_tokens(miss) == 0
    _evict(duet, 100)
    before = duet.stats("prefill")
    assert before["replica_id"] == start["replica_id"]
    assert before["prefix_cache_evictions"] > start["prefix_cache_evictions"]
    hit = complete(duet, p)
    after = duet.stats("prefill")
    assert hit["choices"][0]["text"] == miss["choices"][0]["text"]
    assert cached_tokens(hit) >= HIT
    assert after["kv_tier_cpu_hit_tokens"] - before["kv_tier_cpu_hit_tokens"] >= HIT
    assert after["kv_tier_cpu_hit_bytes"] > before["kv_tier_cpu_hit_bytes"]


def test_prefix_from_replica_1_served_to_replica_2_from_redis(duet, cluster_redis):
    """Replica 1 computed P (then evicted it); replica 2 has an empty pool and an
    empty CPU tier, so only Redis can serve it."""
    # Replica 1 must be new: LMCache 0.5.6 drops the first write on each pooled Redis
    # connection after a Redis restart (broken pipe, logged), and an earlier test may
    # have restarted Redis under the running replica; a dropped write of P would make
    # the hit partial.
    first = _restart_prefill(duet)
    p = prompt(P_LEN, 4)
    miss = complete(duet, p)
    _evict(duet, 200)
    assert duet.stats("prefill")["replica_id"] == first
    _wait_tier_holds(duet, p, {"redis_url": cluster_redis.url + "/0"})
    _restart_prefill(duet)
    hit = complete(duet, p)
    s = duet.stats("prefill")
    assert hit["choices"][0]["text"] == miss["choices"][0]["text"]
    assert cached_tokens(hit) >= HIT, {k: v for k, v in s.items() if k.startswith(("kv_tier", "external"))}
    assert s["kv_tier_redis_hit_tokens"] >= HIT and s["kv_tier_cpu_hit_tokens"] == 0


def test_a_salted_prompt_is_read_from_the_tiers_under_its_salt_only(duet, cluster_redis):
    """Tenant isolation in every tier the pool has: the prompt cached under one
    `cache_salt` is a cold prefill under another (no tier is read), and a hit from the
    CPU tier under its own."""
    p = prompt(P_LEN, 7)
    miss = complete(duet, p, cache_salt="tenant-a")
    assert cached_tokens(miss) == 0
    _evict(duet, 300)
    # The namespace the gateway made of the request's salt (no keys, no per-key isolation).
    namespace = cache_salt(duet.cfg.gateway.cache_isolation, ANONYMOUS, "tenant-a")
    _wait_tier_holds(duet, p, {"redis_url": cluster_redis.url + "/0"}, cache_salt=namespace)
    before = duet.stats("prefill")
    other = complete(duet, p, cache_salt="tenant-b")
    between = duet.stats("prefill")
    assert cached_tokens(other) == 0
    assert other["choices"][0]["text"] == miss["choices"][0]["text"]
    for tier in ("cpu", "redis"):
        assert between[f"kv_tier_{tier}_hit_tokens"] == before[f"kv_tier_{tier}_hit_tokens"], tier
    own = complete(duet, p, cache_salt="tenant-a")
    after = duet.stats("prefill")
    assert after["replica_id"] == before["replica_id"]
    assert cached_tokens(own) >= HIT
    assert own["choices"][0]["text"] == miss["choices"][0]["text"]
    assert after["kv_tier_cpu_hit_tokens"] - between["kv_tier_cpu_hit_tokens"] >= HIT


def test_redis_down_is_skipped_counted_and_recovers(duet, cluster_redis):
    redis = cluster_redis
    cache = duet.cfg.cache
    assert redis.run("stop").returncode == 0
    try:
        # The replica trusts a Redis that answered for up to the check interval; past
        # it, every tier operation probes or skips Redis (monotonic clocks: no race).
        time.sleep(cache.redis_check_interval_s)
        before = duet.stats("prefill")
        r = complete(duet, prompt(300, 2))
        assert r["choices"][0]["text"] is not None
        s = duet.stats("prefill")
        assert s["replica_id"] == before["replica_id"]
        # Skipped, not waited on: every tier operation of the request left Redis out,
        # and Redis was probed (a short fail-fast ping) at least once.
        ops = _tier_ops(s) - _tier_ops(before)
        assert ops > 0
        assert s["kv_tier_redis_skipped"] - before["kv_tier_redis_skipped"] >= ops
        assert s["kv_tier_redis_errors"] > before["kv_tier_redis_errors"]
        assert s["kv_tier_redis_up"] == 0
    finally:
        assert redis.run("start").returncode == 0
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url + "/0")
    keys = client.dbsize()
    # LMCache's own Redis connection fails its first write after a restart (broken
    # pipe, logged) and reconnects; stores must reach Redis again within a few prompts.
    seeds = iter(range(10, 10_000))

    def stored() -> bool:
        if client.dbsize() > keys:
            return True
        complete(duet, prompt(300, next(seeds)))
        return False

    wait_for(stored, 30, interval=0.5, what="stores reaching Redis after it came back")
    assert duet.stats("prefill")["kv_tier_redis_up"] == 1


@pytest.mark.cluster("tiers-disk")
def test_disk_tier_restores_and_survives_a_restart(duet):
    disk = {"disk_path": duet.cfg.cache.disk_path, "disk_bytes": duet.cfg.cache.disk_bytes}
    p = prompt(P_LEN, 5)
    miss = complete(duet, p)
    _evict(duet, 300)
    _wait_tier_holds(duet, p, disk)
    hit = complete(duet, p)
    s = duet.stats("prefill")
    assert hit["choices"][0]["text"] == miss["choices"][0]["text"]
    assert cached_tokens(hit) >= HIT and s["kv_tier_disk_hit_tokens"] >= HIT
    _restart_prefill(duet)
    again = complete(duet, p)
    s = duet.stats("prefill")
    assert again["choices"][0]["text"] == miss["choices"][0]["text"]
    assert s["kv_tier_disk_hit_tokens"] >= HIT
