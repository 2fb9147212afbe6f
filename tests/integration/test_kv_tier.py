"""LMCache KV tier over a small paged KV tensor: store, wipe, retrieve elsewhere, bytes equal.

CPU, disk (a fresh tier on the same path = a replica restart) and Redis (a real
server from scripts/redis.sh on its own port, stopped and restarted by the test).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("lmcache", reason="LMCache not installed (see scripts/setup.sh)")

from duet_cluster import RedisServer, wait_for  # noqa: E402

from prefill.kv_tier.config import KVTierConfig  # noqa: E402
from prefill.kv_tier.stats import REDIS_BACKEND  # noqa: E402
from prefill.kv_tier.tier import KVTier  # noqa: E402

pytestmark = pytest.mark.integration

L, H, D, BS, NB = 2, 3, 8, 16, 32
CHUNK = 32  # two blocks
FP = "test-model|float32|bs16"
TOKENS = list(range(1000, 1000 + 5 * BS + 3))  # 5 full blocks + a partial one
SRC_BLOCKS = [3, 7, 1, 9, 4, 5]
DST_BLOCKS = [20, 21, 22, 23, 24, 25]
STORED = 4 * BS  # two whole chunks; the fifth block is half a chunk, not stored

torch.set_num_threads(1)


def make_kv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(NB, L, 2, BS, H, D, generator=g).to(dtype)


def wait_lookup(tier: KVTier, tokens, expect: int, timeout_s: float = 10.0, cache_salt: str | None = None) -> int:
    """Stores to disk and Redis are asynchronous inside LMCache."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = tier.lookup(tokens, cache_salt)
        if found >= expect or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def store_wipe_retrieve(tier: KVTier, kv: torch.Tensor) -> None:
    kv[DST_BLOCKS] = 0
    assert tier.store(TOKENS, SRC_BLOCKS, len(TOKENS)) == STORED
    assert wait_lookup(tier, TOKENS, STORED) == STORED
    expected = kv[SRC_BLOCKS[:4]].clone()
    kv[SRC_BLOCKS] = 0
    assert tier.retrieve(TOKENS, DST_BLOCKS, len(TOKENS)) == STORED
    assert torch.equal(kv[DST_BLOCKS[:4]], expected)
    assert not kv[DST_BLOCKS[4:]].any()  # nothing past the stored prefix was written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tier_roundtrip_bytes_identical(dtype):
    kv = make_kv(dtype)
    with KVTier(KVTierConfig(cpu_bytes=64 << 20, chunk_size=CHUNK), kv, FP) as tier:
        store_wipe_retrieve(tier, kv)
        assert tier.stats.cpu.hit_tokens == STORED
        assert tier.stats.cpu.hit_bytes == STORED * L * 2 * H * D * kv.element_size()
        assert tier.lookup(list(range(7, 7 + 64))) == 0  # other tokens: miss


def test_the_tier_sends_no_usage_report_unless_asked(monkeypatch):
    # LMCache's usage telemetry is on unless turned off; an operator's setting is kept.
    from lmcache.usage_telemetry import is_usage_tracking_enabled

    monkeypatch.delenv("LMCACHE_TRACK_USAGE", raising=False)
    with KVTier(KVTierConfig(cpu_bytes=64 << 20, chunk_size=CHUNK), make_kv(), FP):
        assert not is_usage_tracking_enabled()


def test_unaligned_retrieve_falls_back_to_slot_copy():
    # A block table whose prefix is shared with another request: still exact.
    kv = make_kv()
    with KVTier(KVTierConfig(cpu_bytes=64 << 20, chunk_size=BS), kv, FP) as tier:
        assert tier.store(TOKENS, SRC_BLOCKS, 2 * BS) == 2 * BS
        expected = kv[SRC_BLOCKS[:2]].clone()
        assert tier.retrieve(TOKENS, DST_BLOCKS, 2 * BS) == 2 * BS
        assert torch.equal(kv[DST_BLOCKS[:2]], expected)


def test_disk_tier_survives_restart(tmp_path):
    cfg = KVTierConfig(disk_path=str(tmp_path / "kv"), disk_bytes=64 << 20, chunk_size=CHUNK)
    kv = make_kv()
    expected = kv[SRC_BLOCKS[:4]].clone()
    with KVTier(cfg, kv, FP) as tier:
        tier.store(TOKENS, SRC_BLOCKS, len(TOKENS))
        assert wait_lookup(tier, TOKENS, STORED) == STORED
    fresh = torch.zeros_like(kv)  # a restarted replica: new process memory, same disk
    with KVTier(cfg, fresh, FP) as tier:
        assert wait_lookup(tier, TOKENS, STORED, timeout_s=2) == STORED
        assert tier.retrieve(TOKENS, DST_BLOCKS, len(TOKENS)) == STORED
        assert torch.equal(fresh[DST_BLOCKS[:4]], expected)
        assert tier.stats.disk.hit_tokens == STORED


def test_tiers_keyed_by_model_fingerprint(tmp_path):
    cfg = KVTierConfig(disk_path=str(tmp_path / "kv"), disk_bytes=64 << 20, chunk_size=CHUNK)
    with KVTier(cfg, make_kv(), FP) as tier:
        tier.store(TOKENS, SRC_BLOCKS, len(TOKENS))
        wait_lookup(tier, TOKENS, STORED)
    with KVTier(cfg, make_kv(), "another-model") as tier:
        assert tier.lookup(TOKENS) == 0


def test_a_salted_prefix_is_found_under_its_salt_only_in_every_tier(tmp_path, redis_server):
    """Tenant isolation: the same tokens stored under one salt are a miss under another
    salt and without one, in the CPU, disk (across a restart) and Redis tiers."""
    disk = KVTierConfig(disk_path=str(tmp_path / "kv"), disk_bytes=64 << 20, chunk_size=CHUNK)
    tiers = {
        "cpu": KVTierConfig(cpu_bytes=64 << 20, chunk_size=CHUNK),
        "disk": disk,
        "redis": KVTierConfig(redis_url=redis_server.url + "/0", chunk_size=CHUNK, namespace="salted"),
    }
    for name, cfg in tiers.items():
        kv = make_kv()
        expected = kv[SRC_BLOCKS[:4]].clone()
        with KVTier(cfg, kv, FP) as tier:
            assert tier.store(TOKENS, SRC_BLOCKS, len(TOKENS), "tenant-a") == STORED
            assert wait_lookup(tier, TOKENS, STORED, cache_salt="tenant-a") == STORED, name
            assert tier.lookup(TOKENS, "tenant-b") == 0, name
            assert tier.lookup(TOKENS) == 0, name
            kv[DST_BLOCKS] = 0
            assert tier.retrieve(TOKENS, DST_BLOCKS, len(TOKENS), cache_salt="tenant-b") == 0, name
            assert not kv[DST_BLOCKS].any(), name
            assert tier.retrieve(TOKENS, DST_BLOCKS, len(TOKENS), cache_salt="tenant-a") == STORED, name
            assert torch.equal(kv[DST_BLOCKS[:4]], expected), name
    with KVTier(disk, make_kv(), FP) as restarted:  # the salt is in the re-indexed file names
        assert wait_lookup(restarted, TOKENS, STORED, timeout_s=2, cache_salt="tenant-a") == STORED
        assert restarted.lookup(TOKENS, "tenant-b") == 0
        assert restarted.lookup(TOKENS) == 0


def test_tiers_of_other_namespaces_are_invisible(redis_server):
    """Two clusters sharing one Redis (and one model) keep their KV apart."""
    url = redis_server.url + "/0"
    ours, theirs = (KVTierConfig(redis_url=url, chunk_size=CHUNK, namespace=ns) for ns in ("team-a", "team-b"))
    with KVTier(ours, make_kv(), FP) as a:
        a.store(TOKENS, SRC_BLOCKS, len(TOKENS))
        assert wait_lookup(a, TOKENS, STORED) == STORED
        with KVTier(ours, make_kv(), FP) as same, KVTier(theirs, make_kv(), FP) as other:
            assert wait_lookup(same, TOKENS, STORED) == STORED
            assert other.lookup(TOKENS) == 0
    with pytest.raises(ValueError):
        KVTierConfig(namespace="a/b")


def test_config_validation():
    with pytest.raises(ValueError, match="disk_path"):
        KVTierConfig(disk_path="/tmp/x")
    with pytest.raises(ValueError, match="redis_url"):
        KVTierConfig(redis_url="http://x")
    with pytest.raises(ValueError, match="multiple of block_size"):
        KVTier(KVTierConfig(cpu_bytes=1 << 20, chunk_size=24), make_kv(), FP)
    with pytest.raises(ValueError, match="at least one tier"):
        KVTier(KVTierConfig(), make_kv(), FP)


# Redis: a private server on its own port so stopping it disturbs nobody.
REDIS_PORT = 6391


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    redis = RedisServer(REDIS_PORT, tmp_path)
    r = redis.run("start")
    if r.returncode != 0:
        pytest.skip(f"Redis could not be started with scripts/redis.sh: {r.stderr.strip()}")
    yield redis
    redis.run("stop")


def test_redis_tier_roundtrip_shared_between_replicas(redis_server):
    cfg = KVTierConfig(redis_url=redis_server.url + "/0", chunk_size=CHUNK)
    kv1, kv2 = make_kv(), torch.zeros(NB, L, 2, BS, H, D)
    with KVTier(cfg, kv1, FP) as replica1, KVTier(cfg, kv2, FP) as replica2:
        replica1.store(TOKENS, SRC_BLOCKS, len(TOKENS))
        assert wait_lookup(replica2, TOKENS, STORED) == STORED
        assert replica2.retrieve(TOKENS, DST_BLOCKS, len(TOKENS)) == STORED
        assert torch.equal(kv2[DST_BLOCKS[:4]], kv1[SRC_BLOCKS[:4]])
        assert replica2.stats.redis.hit_tokens == STORED


def _ops(tier: KVTier) -> int:
    """Tier operations so far (each one checks Redis first)."""
    return tier.stats.lookups + tier.stats.retrieves + tier.stats.stores


def test_redis_down_is_skipped_and_counted_then_recovers(redis_server):
    cfg = KVTierConfig(
        cpu_bytes=64 << 20, redis_url=redis_server.url + "/0", chunk_size=CHUNK, redis_retry_interval_s=0.2,
        close_timeout_s=3,
    )
    kv = make_kv()
    with KVTier(cfg, kv, FP) as tier:

        def bypassed() -> bool:  # LMCache itself leaves its Redis backend out
            return tier._engine.storage_manager.is_backend_bypassed(REDIS_BACKEND)

        assert not bypassed()
        assert redis_server.run("stop").returncode == 0
        # The tier trusts a Redis that answered for up to the check interval; past it,
        # every operation probes or skips Redis (one monotonic clock: no race).
        time.sleep(cfg.redis_check_interval_s)
        ops0, skipped0, probes0 = _ops(tier), tier.stats.redis.skipped, tier.stats.redis.errors
        t0 = time.monotonic()
        store_wipe_retrieve(tier, kv)  # CPU tier keeps serving
        window = time.monotonic() - t0
        # Skipped, not waited on: every operation left Redis out, and LMCache did not
        # try it either ...
        ops = _ops(tier) - ops0
        assert ops > 0 and tier.stats.redis.skipped - skipped0 == ops
        assert bypassed()
        # ... and the outage cost one fail-fast probe per retry interval, not one per
        # operation (a slower run only widens the allowance).
        probes = tier.stats.redis.errors - probes0
        assert 1 <= probes <= 1 + window / cfg.redis_retry_interval_s, (probes, window)
        assert tier.stats.cpu.hit_tokens == STORED

        assert redis_server.run("start").returncode == 0
        other = list(range(5000, 5000 + 2 * CHUNK))

        def back() -> bool:
            tier.lookup(other)  # an operation: past the retry interval it probes Redis again
            return not bypassed()

        wait_for(back, 10, interval=0.05, what="Redis used again")
        assert tier.store(other, SRC_BLOCKS, len(other)) == 2 * CHUNK

        def in_redis() -> bool:  # Redis itself holds it (LMCache writes asynchronously)
            return tier._engine.lookup(torch.tensor(other), search_range=["RemoteBackend"]) == 2 * CHUNK

        wait_for(in_redis, 10, interval=0.05, what="the chunks in Redis")
