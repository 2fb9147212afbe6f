"""LMCache tiers in the prefill pool, end to end through the gateway (real Ray,
real Redis): a prompt evicted from the block pool, or computed by a replica that
is gone, is served from the CPU, disk or Redis tier with the same greedy tokens
as a miss; Redis down is skipped and counted, and Redis coming back is used again.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("lmcache", reason="LMCache not installed (see scripts/setup.sh)")

from conftest_kv import (  # noqa: E402
    RedisServer,
    base_config,
    cached_tokens,
    complete,
    deploy,
    free_port,
    kill_replicas,
    prefill_handle,
    prompt,
    start_ray,
    stop_ray,
    wait_replicas,
)

pytestmark = pytest.mark.integration

CHUNK = 128
P_LEN = 600  # → 4 whole chunks (512 tokens) in the tiers
HIT = 512
REDIS_PORT = 6393


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    redis = RedisServer(REDIS_PORT, tmp_path_factory.mktemp("redis"))
    if redis.run("start").returncode != 0:
        pytest.skip("Redis could not be started with scripts/redis.sh")
    redis.flush()
    owned, port = start_ray(free_port())
    yield {"redis": redis, "port": port, "disk": tmp_path_factory.mktemp("kvdisk")}
    stop_ray(owned)
    redis.run("stop")


def _config(port, cache: dict) -> dict:
    # 64 blocks of 16 tokens per pool: two 900-token fillers evict any earlier prompt.
    return base_config(
        port,
        engine={"num_kv_blocks": 64},
        cache={"chunk_size": CHUNK, "redis_retry_interval_s": 0.5, **cache},
    )


def _stats() -> dict:
    return asyncio.run(_remote_stats())


async def _remote_stats():
    return await prefill_handle().stats.remote()


def _evict(url: str, seed: int) -> None:
    for i in range(2):
        complete(url, prompt(900, seed + i), max_tokens=2)


def _wait_tier_holds(ids: list[int], tier: dict, timeout: float = 30.0) -> None:
    """Wait until a tier (Redis or disk: the replica writes them asynchronously) holds
    the whole chunks of `ids`, read through a `KVTier` of our own with the replicas'
    model fingerprint and KV layout."""
    import torch

    from cluster.config import ClusterConfig
    from engine.engine import expected_model_fingerprint
    from prefill.kv_tier.tier import KVTier

    cfg = ClusterConfig.model_validate(_config(1, tier))
    kv = torch.zeros(4, 30, 2, cfg.engine.block_size, 3, 64)  # SmolLM2's layout, fp32
    want = len(ids) // CHUNK * CHUNK
    deadline = time.monotonic() + timeout
    while True:
        with KVTier(cfg.cache, kv, expected_model_fingerprint(cfg.engine)) as reader:
            if reader.lookup(ids) >= want:
                return
        assert time.monotonic() < deadline, f"the tier {tier} never held the prompt's chunks"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cpu_redis_app(cluster):
    cfg = _config(cluster["port"], {"cpu_bytes": 256 << 20, "redis_url": cluster["redis"].url + "/0"})
    return deploy(cfg)


def test_cpu_tier_restores_an_evicted_prompt(cpu_redis_app):
    url = cpu_redis_app
    p = prompt(P_LEN, 1)
    miss = complete(url, p)
    assert cached_tokens(miss) == 0
    _evict(url, 100)
    before = _stats()
    assert before["prefix_cache_evictions"] > 0
    hit = complete(url, p)
    after = _stats()
    assert hit["choices"][0]["text"] == miss["choices"][0]["text"]
    assert cached_tokens(hit) >= HIT
    assert after["kv_tier_cpu_hit_tokens"] - before["kv_tier_cpu_hit_tokens"] >= HIT
    assert after["kv_tier_cpu_hit_bytes"] > before["kv_tier_cpu_hit_bytes"]


def test_prefix_from_replica_1_served_to_replica_2_from_redis(cluster, cpu_redis_app):
    """Replica 1 computed P (then evicted it); replica 2 has an empty pool and an
    empty CPU tier, so only Redis can serve it."""
    url = cpu_redis_app
    p = prompt(P_LEN, 4)
    miss = complete(url, p)
    _evict(url, 200)
    first = _stats()
    _wait_tier_holds(p, {"redis_url": cluster["redis"].url + "/0"})
    assert kill_replicas("prefill")
    wait_replicas("prefill", 1, 180)
    deadline = time.monotonic() + 60
    while True:
        try:
            s = _stats()
            if s["replica_id"] != first["replica_id"]:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "no new prefill replica"
        time.sleep(1)
    hit = complete(url, p)
    s = _stats()
    assert hit["choices"][0]["text"] == miss["choices"][0]["text"]
    assert cached_tokens(hit) >= HIT, {k: v for k, v in s.items() if k.startswith(("kv_tier", "external"))}
    assert s["kv_tier_redis_hit_tokens"] >= HIT and s["kv_tier_cpu_hit_tokens"] == 0


def test_redis_down_is_skipped_counted_and_recovers(cluster, cpu_redis_app):
    # Runs after the Redis-sharing test: LMCache 0.5.6 drops the first write on each
    # pooled Redis connection after a Redis restart (broken pipe, logged), which
    # would turn that test's hit into a partial one.
    url, redis = cpu_redis_app, cluster["redis"]
    assert redis.run("stop").returncode == 0
    try:
        t0 = time.monotonic()
        r = complete(url, prompt(300, 2))
        assert r["choices"][0]["text"] is not None
        assert time.monotonic() - t0 < 30
        s = _stats()
        assert s["kv_tier_redis_skipped"] > 0 and s["kv_tier_redis_up"] == 0
    finally:
        assert redis.run("start").returncode == 0
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url + "/0")
    keys = client.dbsize()
    # LMCache's own Redis connection fails its first write after a restart (broken
    # pipe, logged) and reconnects; stores must reach Redis again within a few prompts.
    deadline = time.monotonic() + 30
    seed = 10
    while client.dbsize() <= keys:
        assert time.monotonic() < deadline, "stores never reached Redis after it came back"
        complete(url, prompt(300, seed))
        seed += 1
        time.sleep(0.5)
    assert _stats()["kv_tier_redis_up"] == 1


def test_disk_tier_restores_and_survives_a_restart(cluster):
    disk = {"disk_path": str(cluster["disk"]), "disk_bytes": 1 << 30}
    url = deploy(_config(cluster["port"], disk))
    p = prompt(P_LEN, 5)
    miss = complete(url, p)
    _evict(url, 300)
    _wait_tier_holds(p, disk)
    hit = complete(url, p)
    s = _stats()
    assert hit["choices"][0]["text"] == miss["choices"][0]["text"]
    assert cached_tokens(hit) >= HIT and s["kv_tier_disk_hit_tokens"] >= HIT
    first = s["replica_id"]
    assert kill_replicas("prefill")
    wait_replicas("prefill", 1, 180)
    deadline = time.monotonic() + 60
    while True:
        try:
            if _stats()["replica_id"] != first:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "no new prefill replica"
        time.sleep(1)
    again = complete(url, p)
    s = _stats()
    assert again["choices"][0]["text"] == miss["choices"][0]["text"]
    assert s["kv_tier_disk_hit_tokens"] >= HIT
