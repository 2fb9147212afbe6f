"""The KV-aware prefill router on a real Serve app with two prefill replicas and
the Redis prefix index (real Ray, real Redis).

Prefill calls go through a driver-side handle: Serve builds the same
`KVAwarePrefillRouter` there as in the gateway, and each `PrefillResult` names the
replica that computed it. Leases are rejected at once so blocks stay evictable.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from conftest_kv import (
    APP,
    router_settled,
    RedisServer,
    base_config,
    deploy,
    free_port,
    prefill_direct,
    prefill_handle,
    prompt,
    start_ray,
    stop_ray,
    wait_replicas,
)

pytestmark = pytest.mark.integration

REDIS_PORT = 6392
SYSTEM = prompt(320, 7)  # a hot system prompt: 20 blocks


def _config(port: int, redis_url: str, replicas: int = 2) -> dict:
    return base_config(
        port,
        prefill={"replicas": replicas},
        router={"prefix_index": "redis", "redis_url": redis_url, "index_key_prefix": "duet:test-routing",
                "imbalance_threshold": 48, "stats_period_s": 0.2},
    )


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    redis = RedisServer(REDIS_PORT, tmp_path_factory.mktemp("redis"))
    if redis.run("start").returncode != 0:
        pytest.skip("Redis could not be started with scripts/redis.sh")
    redis.flush()
    owned, port = start_ray(free_port())
    url = redis.url + "/0"
    deploy(_config(port, url))
    yield {"port": port, "redis_url": url}
    stop_ray(owned)
    redis.run("stop")


def _replica(result) -> str:
    return result.kv_handle.prefill_replica_id


def _index():
    from kvtransfer.events.prefix_index import RedisPrefixIndex

    return RedisPrefixIndex(f"redis://127.0.0.1:{REDIS_PORT}/0", key_prefix="duet:test-routing")


def _hashes(ids):
    from cluster.config import ClusterConfig
    from engine.engine import expected_model_fingerprint
    from engine.hashing import block_hashes

    cfg = ClusterConfig.model_validate(base_config(1))
    return block_hashes(ids, 16, expected_model_fingerprint(cfg.engine))


def _wait_indexed(ids, replica: str, timeout: float = 10.0) -> None:
    index, hashes = _index(), _hashes(ids)
    deadline = time.monotonic() + timeout
    while index.match(hashes).get(replica, 0) < len(hashes) - 1:
        assert time.monotonic() < deadline, "KV events did not reach the index"
        time.sleep(0.1)


def test_requests_sharing_a_prefix_go_to_the_replica_holding_it(app):
    """Waits for the state each decision needs: the index holds the prefix, and the
    router has seen the previous request complete (Serve tells it on its own thread,
    possibly after the caller got the result). Given that, the load it sees is exact
    whatever the report timing: reports name the requests they count."""

    async def run():
        h = prefill_handle()
        out = {}
        for k in range(2):
            base = prompt(256, 100 + k)
            first = await prefill_direct(h, base + prompt(20, 200 + k))
            holder = _replica(first)
            _wait_indexed(base, holder)
            followers = []
            for i in range(5):
                await router_settled(h)
                followers.append(await prefill_direct(h, base + prompt(30, 300 + 10 * k + i)))
            out[k] = (holder, [_replica(r) for r in followers], [r.num_cached_tokens for r in followers])
        return out

    for holder, chosen, cached in asyncio.run(run()).values():
        assert chosen == [holder] * 5
        assert all(c >= 256 for c in cached)


def test_hot_system_prompt_under_load_is_spread(app):
    """A burst on one hot prefix reaches both replicas. How far it spreads is the
    policy's, given the load it sees (tests/unit/test_router_decisions.py and
    test_router_cost.py check the shares exactly); here the state is real and only
    "never all on one replica" is timing-free."""

    async def run():
        h = prefill_handle()
        first = await prefill_direct(h, SYSTEM + prompt(40, 1))
        _wait_indexed(SYSTEM, _replica(first))
        results = await asyncio.gather(*(prefill_direct(h, SYSTEM + prompt(60, 1000 + i)) for i in range(40)))
        return Counter(_replica(r) for r in results)

    counts = asyncio.run(run())
    assert sum(counts.values()) == 40
    assert len(counts) == 2, counts


def test_a_restarted_router_keeps_routing_by_prefix(app):
    """A new process (a Ray task) has a brand-new router: the Redis index is all it knows."""
    import ray

    async def seed():
        base = prompt(256, 555)
        r = await prefill_direct(prefill_handle(), base + prompt(20, 556))
        _wait_indexed(base, _replica(r))
        return base, _replica(r)

    base, holder = asyncio.run(seed())

    @ray.remote(num_cpus=0)
    def fresh_router(ids, app_name):
        import asyncio as aio

        from ray import serve as srv

        from engine.sampling_params import SamplingParams
        from kvtransfer.handoff import reject_lease
        from kvtransfer.messages import RejectReason

        async def go():
            h = srv.get_deployment_handle("prefill", app_name)
            out = []
            for i in range(3):
                if i:  # the fresh router has seen the previous request complete
                    router = h._router._asyncio_router.request_router
                    for _ in range(600):
                        if router.pending() == 0:
                            break
                        await aio.sleep(0.05)
                r = await h.prefill.remote(f"fresh-{i}", ids + [100 + i] * 17, SamplingParams(max_tokens=2))
                reject_lease(r.kv_handle, RejectReason.CLIENT_DISCONNECTED, timeout_s=5.0)
                out.append(r.kv_handle.prefill_replica_id)
            return out

        return aio.run(go())

    chosen = ray.get(fresh_router.remote(base, APP), timeout=120)
    assert chosen == [holder] * 3


def test_removing_a_replica_clears_its_entries(app):
    index = _index()

    async def seed():
        h = prefill_handle()
        return [_replica(await prefill_direct(h, prompt(200, 900 + i))) for i in range(6)]

    holders = set(asyncio.run(seed()))
    deadline = time.monotonic() + 10
    while not holders <= index.replicas():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    before = index.replicas()
    deploy(_config(app["port"], app["redis_url"], replicas=1))
    wait_replicas("prefill", 1)

    async def touch():  # the driver's router sees the new replica set
        await prefill_direct(prefill_handle(), prompt(40, 4242))

    async def current():
        return (await prefill_handle().stats.remote())["replica_id"]

    # A redeploy with other init args replaces every replica: whichever replica runs
    # now may be new; every one that left must be gone from the index.
    running = asyncio.run(current())
    deadline = time.monotonic() + 30
    while index.replicas() - {running}:
        asyncio.run(touch())
        assert time.monotonic() < deadline, index.replicas()
        time.sleep(0.5)
    for rid in before - {running}:
        assert not index._client.exists(f"duet:test-routing:r:{rid}")
