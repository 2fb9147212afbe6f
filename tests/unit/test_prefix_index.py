"""Prefix index fed by KV events: in-process and Redis (a real server from scripts/redis.sh)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from engine.hashing import block_hashes
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtransfer.events.prefix_index import (
    InProcessPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
    fail_fast_client,
)

pytestmark = pytest.mark.unit

BS = 4
FP = "test-model"
REPO = Path(__file__).resolve().parents[2]
REDIS_PORT = int(os.environ.get("DUET_REDIS_PORT", "6390"))
REDIS_URL = f"redis://127.0.0.1:{REDIS_PORT}/0"


def stored(tokens):
    hs = tuple(block_hashes(tokens, BS, FP))
    return BlockStored(hs, None, len(hs) * BS)


@pytest.fixture(scope="module")
def redis_server():
    script = REPO / "scripts" / "redis.sh"
    try:
        subprocess.run([str(script), "start"], check=True, capture_output=True, timeout=120)
        import redis

        redis.Redis.from_url(REDIS_URL, socket_timeout=1).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no Redis here"
        pytest.skip(f"Redis could not be started with scripts/redis.sh on port {REDIS_PORT}: {exc}")
    return REDIS_URL


@pytest.fixture(params=["inprocess", "redis"])
def index(request):
    if request.param == "inprocess":
        yield InProcessPrefixIndex()
        return
    url = request.getfixturevalue("redis_server")
    idx = RedisPrefixIndex(url, key_prefix=f"duet-test:{uuid.uuid4().hex}")
    yield idx
    idx.clear()
    idx.close()


A = list(range(100, 116))  # 4 blocks
B = A[:8] + list(range(900, 908))  # shares 2 leading blocks with A


def test_match_counts_leading_run_per_replica(index: PrefixIndex):
    index.apply("r1", [stored(A)])
    index.apply("r2", [stored(B)])
    assert index.match(block_hashes(A, BS, FP)) == {"r1": 4, "r2": 2}
    assert index.match(block_hashes(B + [1, 2, 3, 4], BS, FP)) == {"r1": 2, "r2": 4}
    assert index.match(block_hashes([7] * 16, BS, FP)) == {}
    assert index.match([]) == {}
    assert index.replicas() == {"r1", "r2"}


def test_gap_ends_the_run(index: PrefixIndex):
    hs = block_hashes(A, BS, FP)
    index.apply("r1", [stored(A), BlockRemoved((hs[1],))])
    assert index.match(hs) == {"r1": 1}


def test_all_blocks_cleared_then_stored_again(index: PrefixIndex):
    index.apply("r1", [stored(A)])
    index.apply("r2", [stored(A)])
    index.apply("r1", [AllBlocksCleared(), stored(A[:8])])
    assert index.match(block_hashes(A, BS, FP)) == {"r1": 2, "r2": 4}


def test_remove_replica_clears_its_entries(index: PrefixIndex):
    index.apply("r1", [stored(A)])
    index.apply("r2", [stored(B)])
    index.remove_replica("r1")
    assert index.replicas() == {"r2"}
    assert index.match(block_hashes(A, BS, FP)) == {"r2": 2}
    index.remove_replica("r2")
    assert index.match(block_hashes(B, BS, FP)) == {}
    assert index.replicas() == set()


def test_in_process_index_drops_empty_hash_entries():
    index = InProcessPrefixIndex()
    index.apply("r1", [stored(A)])
    index.remove_replica("r1")
    assert index.num_blocks() == 0


def test_redis_index_survives_router_restart_and_is_shared(redis_server):
    prefix = f"duet-test:{uuid.uuid4().hex}"
    first = RedisPrefixIndex(redis_server, key_prefix=prefix)
    first.apply("r1", [stored(A)])
    first.close()
    second = RedisPrefixIndex(redis_server, key_prefix=prefix)  # a restarted or second router
    try:
        assert second.match(block_hashes(A, BS, FP)) == {"r1": 4}
        second.remove_replica("r1")
        assert second.replicas() == set()
    finally:
        second.clear()
        second.close()


def test_redis_index_never_raises_when_redis_is_down_and_replays_on_recovery(redis_server):
    import redis

    now = [0.0]
    good = redis.Redis.from_url(redis_server, socket_timeout=1)
    dead = fail_fast_client("redis://127.0.0.1:1/0", 0.2)
    client = _SwitchableClient(dead)
    prefix = f"duet-test:{uuid.uuid4().hex}"
    idx = RedisPrefixIndex(key_prefix=prefix, client=client, retry_interval_s=1.0, clock=lambda: now[0])
    try:
        idx.apply("r1", [stored(A)])  # lost connection: buffered, counted
        assert idx.errors == 1 and not idx.healthy
        assert idx.match(block_hashes(A, BS, FP)) == {}  # router falls back to load only
        idx.remove_replica("r2")
        assert idx.errors == 1  # inside the retry interval Redis is not even tried
        client.target = good
        now[0] = 2.0
        assert idx.match(block_hashes(A, BS, FP)) == {"r1": 4}  # replayed
        assert idx.replicas() == {"r1"}
    finally:
        idx.clear()
        good.close()


def test_redis_index_buffer_overflow_clears_replica_on_recovery(redis_server):
    import redis

    now = [0.0]
    good = redis.Redis.from_url(redis_server, socket_timeout=1)
    prefix = f"duet-test:{uuid.uuid4().hex}"
    client = _SwitchableClient(good)
    idx = RedisPrefixIndex(
        key_prefix=prefix, client=client, max_pending_events=1, clock=lambda: now[0]
    )
    try:
        idx.apply("r1", [stored(A)])
        client.target = fail_fast_client("redis://127.0.0.1:1/0", 0.2)
        hs = block_hashes(A, BS, FP)
        idx.apply("r1", [BlockRemoved((hs[0],)), BlockRemoved((hs[1],))])  # > buffer: lost
        client.target = good
        now[0] = 5.0
        # Stale "r1 holds A" would be wrong; cleared is merely conservative.
        assert idx.match(hs) == {}
        assert idx.replicas() == {"r1"}
    finally:
        idx.clear()
        good.close()


class _SwitchableClient:
    """Delegates to `target`, so a test can cut and restore the connection."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        return getattr(self.target, name)
