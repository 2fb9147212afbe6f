"""The KV-aware prefill router on a real Serve app with two prefill replicas and
the Redis prefix index (real Ray, real Redis).

Prefill calls go through a driver-side handle: Serve builds the same
`KVAwarePrefillRouter` there as in the gateway, and each `PrefillResult` names the
replica that computed it. Leases are rejected at once so blocks stay evictable.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
from duet_cluster import APP_NAME, Duet, describe_router, fresh_handle, prompt, shut_down, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cluster("kv-routing")]

CALL_TIMEOUT_S = 60.0  # one prefill on this 2-core machine takes well under a second

SYSTEM = prompt(320, 7)  # a hot system prompt: 20 blocks


@pytest.fixture
def new_router():
    """Makes prefill handles, each with a new KV-aware router in this process (its own
    view of load, built from the running config's router settings); shut down after."""
    handles = []

    def make():
        handles.append(fresh_handle("prefill"))
        return handles[-1]

    yield make
    shut_down(handles)


async def prefill_direct(handle, ids: list[int]):
    """One prefill through the pool's router; the lease is rejected at once."""
    from engine.sampling_params import SamplingParams
    from kvtransfer.messages import PrefillRequest

    req = PrefillRequest(f"t-{random.getrandbits(48):x}", ids, SamplingParams(max_tokens=4, temperature=0))
    try:  # a call this driver's router never places fails the test, not the suite
        result = await asyncio.wait_for(handle.prefill.remote(req), CALL_TIMEOUT_S)
    except TimeoutError:
        raise AssertionError(f"prefill unanswered after {CALL_TIMEOUT_S:.0f} s; "
                             f"this driver's router: {describe_router(handle)}") from None
    reject_now(result)
    return result


def reject_now(result) -> None:
    """Free a prefill result's lease at once (nobody will pull it)."""
    from kvtransfer.handoff import reject_lease
    from kvtransfer.messages import RejectReason

    if result.kv_handle is not None:
        reject_lease(result.kv_handle, RejectReason.CLIENT_DISCONNECTED, timeout_s=5.0)


def request_router(handle):
    """The KV-aware router Serve built in this process for `handle` (at its first call)."""
    return handle._router._asyncio_router.request_router


async def router_settled(handle, timeout: float = 30.0) -> None:
    """Wait until the KV-aware router Serve built in this process for `handle` has seen
    every request it sent complete (its completion callbacks run on Serve's router
    thread, possibly after the caller already has the result)."""
    router = request_router(handle)
    deadline = time.monotonic() + timeout
    while router.pending():
        assert time.monotonic() < deadline, "the router never saw its requests complete"
        await asyncio.sleep(0.02)


def _replica(result) -> str:
    return result.kv_handle.prefill_replica_id


def _index(duet: Duet):
    """The app's Redis prefix index, read directly."""
    from kvtransfer.events.prefix_index import RedisPrefixIndex

    return RedisPrefixIndex(duet.cfg.router.redis_url, key_prefix=duet.cfg.router.index_key_prefix)


def _hashes(duet: Duet, ids):
    from engine.engine import expected_model_fingerprint
    from engine.hashing import block_hashes

    return block_hashes(ids, duet.cfg.engine.block_size, expected_model_fingerprint(duet.cfg.engine))


def _wait_indexed(duet: Duet, ids, replica: str, timeout: float = 10.0) -> None:
    index, hashes = _index(duet), _hashes(duet, ids)
    wait_for(lambda: index.match(hashes).get(replica, 0) >= len(hashes) - 1, timeout, interval=0.1,
             what="the prefix's KV events in the index")


def test_requests_sharing_a_prefix_go_to_the_replica_holding_it(duet, new_router):
    """Waits for the state each decision needs: the index holds the prefix, and the
    router has seen the previous request complete (Serve tells it on its own thread,
    possibly after the caller got the result). Given that, the load it sees is exact
    whatever the report timing: reports name the requests they count."""

    async def run():
        h = new_router()
        out = {}
        for k in range(2):
            base = prompt(256, 100 + k)
            first = await prefill_direct(h, base + prompt(20, 200 + k))
            # The router is this config's (a stale one chose by another index: the tie-break).
            assert request_router(h).config == duet.cfg.router
            holder = _replica(first)
            _wait_indexed(duet, base, holder)
            followers = []
            for i in range(5):
                await router_settled(h)
                followers.append(await prefill_direct(h, base + prompt(30, 300 + 10 * k + i)))
            out[k] = (holder, [_replica(r) for r in followers], [r.num_cached_tokens for r in followers])
        return out

    for holder, chosen, cached in asyncio.run(run()).values():
        assert chosen == [holder] * 5
        assert all(c >= 256 for c in cached)


def test_hot_system_prompt_under_load_is_spread(duet, new_router):
    """A burst on one hot prefix reaches both replicas. How far it spreads is the
    policy's, given the load it sees (tests/unit/test_router_decisions.py and
    test_router_cost.py check the shares exactly); here the state is real and only
    "never all on one replica" is timing-free."""

    async def run():
        h = new_router()
        first = await prefill_direct(h, SYSTEM + prompt(40, 1))
        _wait_indexed(duet, SYSTEM, _replica(first))
        results = await asyncio.gather(*(prefill_direct(h, SYSTEM + prompt(60, 1000 + i)) for i in range(40)))
        return Counter(_replica(r) for r in results)

    counts = asyncio.run(run())
    assert sum(counts.values()) == 40
    assert len(counts) == 2, counts


def test_a_restarted_router_keeps_routing_by_prefix(duet, new_router):
    """A new process (a Ray task) has a brand-new router: the Redis index is all it knows."""
    import ray

    async def seed():
        base = prompt(256, 555)
        r = await prefill_direct(new_router(), base + prompt(20, 556))
        _wait_indexed(duet, base, _replica(r))
        return base, _replica(r)

    base, holder = asyncio.run(seed())

    @ray.remote(num_cpus=0)
    def fresh_router(ids, app_name):
        import asyncio as aio

        from ray.serve.handle import DeploymentHandle

        from engine.sampling_params import SamplingParams
        from kvtransfer.handoff import reject_lease
        from kvtransfer.messages import PrefillRequest, RejectReason

        async def go():
            h = DeploymentHandle("prefill", app_name)  # not a cached one: a new router
            out = []
            for i in range(3):
                if i:  # the fresh router has seen the previous request complete
                    router = h._router._asyncio_router.request_router
                    for _ in range(600):
                        if router.pending() == 0:
                            break
                        await aio.sleep(0.05)
                r = await h.prefill.remote(PrefillRequest(f"fresh-{i}", ids + [100 + i] * 17,
                                                          SamplingParams(max_tokens=2)))
                reject_lease(r.kv_handle, RejectReason.CLIENT_DISCONNECTED, timeout_s=5.0)
                out.append(r.kv_handle.prefill_replica_id)
            return out

        return aio.run(go())

    chosen = ray.get(fresh_router.remote(base, APP_NAME), timeout=120)
    assert chosen == [holder] * 3


def test_removing_a_replica_clears_its_entries(deployer, duet, new_router):
    """A router that was running before the resize sees the replica leave: it forgets
    it, and its entries leave the shared index. Serve pushes the new replica set to
    every router (this driver's and the gateway's) without a request, so the test waits
    for that state and sends nothing through the resized pool."""
    index = _index(duet)
    h = new_router()

    async def seed():
        return [_replica(await prefill_direct(h, prompt(200, 900 + i))) for i in range(6)]

    holders = set(asyncio.run(seed()))
    wait_for(lambda: holders <= index.replicas(), 10, interval=0.1, what=f"{sorted(holders)} in the index")
    before = index.replicas()
    deployer("kv-routing", {"prefill.replicas": 1})  # returns once only the one replica runs
    # Resizing drains one replica and keeps the other (cluster/serve_config.py).
    running = duet.stats("prefill")["replica_id"]
    driver_router = request_router(h)
    wait_for(lambda: driver_router._known == {running}, 60, interval=0.2,
             what=f"this driver's router to know only {running} ({describe_router(h)})")
    wait_for(lambda: not index.replicas() - {running}, 30, interval=0.2, what=f"only {running} in the index")
    for rid in before - {running}:
        assert not index._client.exists(f"{duet.cfg.router.index_key_prefix}:r:{rid}")
