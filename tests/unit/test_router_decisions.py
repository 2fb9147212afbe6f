"""The KV-aware Serve routers' decisions given a known state, without Ray.

The routers only gather a snapshot (replica reports, the prefix index, what this
router itself has in flight) and apply the pure policy. Here the state is built by
hand, the way Serve would hand it over, so each decision is exact; that the state
really arrives is checked by the integration tests.
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from autoscaling.placement import DecodeSide
from engine.hashing import block_hashes
from engine.kv_events import BlockStored
from engine.sampling_params import SamplingParams
from kvtransfer.events.log import KVEventLog
from kvtransfer.messages import PrefillRequest, RoutingStats
from routing.router.serve_routers import (
    PICK_ONLY,
    KVAwareAggregatedRouter,
    KVAwareDecodeRouter,
    KVAwarePrefillRouter,
)

pytestmark = pytest.mark.unit

BS = 16
FP = "model|float32"
_ids = itertools.count()


def replica(name: str, **stats) -> SimpleNamespace:
    """A `RunningReplica` as the router sees it: an id and its last routing stats."""
    rid = SimpleNamespace(deployment_id=SimpleNamespace(name="prefill"), unique_id=name)
    report = RoutingStats(kv_blocks_free=100, kv_blocks_total=100).to_wire() | stats
    return SimpleNamespace(replica_id=rid, routing_stats=report)


def pending(prompt: list[int], cache_salt: str | None = None) -> SimpleNamespace:
    n = next(_ids)
    return SimpleNamespace(
        metadata=SimpleNamespace(internal_request_id=f"internal-{n}", call_method="prefill"),
        args=(PrefillRequest(f"req-{n}", tuple(prompt), SamplingParams(), cache_salt=cache_salt),),
        kwargs={},
    )


def router(**config) -> KVAwarePrefillRouter:
    r = object.__new__(KVAwarePrefillRouter)  # Serve's base __init__ needs a controller
    r.initialize_state(config=config, block_size=BS, model_fingerprint=FP, seed=0)
    return r


def holding(prefix: list[int], cache_salt: str | None = None) -> KVEventLog:
    log = KVEventLog(BS)
    log.extend([BlockStored(tuple(block_hashes(prefix, BS, FP, cache_salt)), None, len(prefix))])
    return log


def choose(r: KVAwarePrefillRouter, replicas, prompt, cache_salt: str | None = None) -> tuple[str, SimpleNamespace]:
    pr = pending(prompt, cache_salt)
    ranked = asyncio.run(r.choose_replicas(replicas, pr))
    return ranked[0][0].replica_id.unique_id, pr


PREFIX = list(range(1000, 1000 + 16 * BS))  # 16 blocks


def test_a_shared_prefix_goes_to_its_holder_even_when_its_report_is_stale():
    """The report of the holder still counts the previous request, which this router
    has seen finish: it is taken off, so the holder is idle, not loaded."""
    r = router()
    a = replica("a", kv_log=holding(PREFIX).window())
    b = replica("b")
    r._sync([a, b])
    for i in range(5):
        prompt = PREFIX + [i] * 30
        chosen, pr = choose(r, [a, b], prompt)
        assert chosen == "a"
        r.on_request_routed(pr, a.replica_id, None)
        r.on_request_completed(a.replica_id, pr.metadata.internal_request_id)
        # The replica reported while the request was queued; that report is still current.
        a.routing_stats.update(queued_prefill_tokens=len(prompt), num_requests=1, request_ids=[pr.args[0].request_id])


def test_a_salted_request_matches_only_its_own_salts_prefix():
    """The router hashes the prompt with the request's salt, as the replicas do: a
    tenant's request goes to its own cached prefix, never to another's."""
    r = router()
    a = replica("a", kv_log=holding(PREFIX, "tenant-a").window())
    b = replica("b", kv_log=holding(PREFIX).window())
    r._sync([a, b])
    assert choose(r, [a, b], PREFIX + [1] * 30, "tenant-a")[0] == "a"
    assert choose(r, [a, b], PREFIX + [2] * 30)[0] == "b"
    assert r.index.match(block_hashes(PREFIX, BS, FP, "tenant-b")) == {}


def test_a_report_of_requests_still_running_counts_as_load():
    r = router(imbalance_threshold=1e9)
    a = replica("a", kv_log=holding(PREFIX).window(), queued_prefill_tokens=40 * BS, num_requests=3,
                request_ids=["other-router-1", "other-router-2", "other-router-3"])
    b = replica("b")
    r._sync([a, b])
    assert choose(r, [a, b], PREFIX + [7] * 30)[0] == "b"


def test_a_burst_sees_the_decisions_just_before_it():
    """Forty decisions before anything is sent: each counts the ones before it, so the
    cheap replica (it holds the prefix) takes more, never all."""
    r = router(imbalance_threshold=48)
    a = replica("a", kv_log=holding(PREFIX).window())
    b = replica("b")
    r._sync([a, b])
    chosen = [choose(r, [a, b], PREFIX + [i] * 60)[0] for i in range(40)]
    assert 20 < chosen.count("a") < 40 and "b" in chosen[:10], chosen


def test_a_decision_never_sent_stops_counting():
    r = router()
    a, b = replica("a"), replica("b")
    r._sync([a, b])
    chosen, pr = choose(r, [a, b], [5] * 64)
    assert r._local(f"prefill#{chosen}") == (64, 1)
    planned = r._planned[pr.metadata.internal_request_id]
    r._planned[pr.metadata.internal_request_id] = planned.__class__(
        planned.key, planned.request_id, planned.tokens, planned.counted, planned.expires_at - 60
    )
    choose(r, [a, b], [6] * 16)  # the next decision drops it
    assert pr.metadata.internal_request_id not in r._planned


def test_a_call_that_completes_before_serve_reports_it_routed_is_not_load():
    """Serve registers a call's done-callback before it reads the replica's accept, so
    a short call can complete first. Counted as routed after that, it would be load on
    its replica for good, and every later decision would avoid that replica."""
    r = router()
    a, b = replica("a"), replica("b")
    r._sync([a, b])
    chosen, pr = choose(r, [a, b], [5] * 64)
    replica_id = (a if chosen == "a" else b).replica_id
    r.on_request_completed(replica_id, pr.metadata.internal_request_id)
    r.on_request_routed(pr, replica_id, None)
    assert r._local(f"prefill#{chosen}") == (0, 0) and r.pending() == 0


def test_a_rejected_call_routed_again_to_the_same_replica_is_load():
    """A replica that rejects a call completes it; Serve then routes the same call
    again, and may send it to that replica: there it runs, and counts."""
    r = router()
    a, b = replica("a"), replica("b")
    r._sync([a, b])
    chosen, pr = choose(r, [a, b], [5] * 64)
    replica_id = (a if chosen == "a" else b).replica_id
    r.on_request_completed(replica_id, pr.metadata.internal_request_id)  # rejected: full
    assert asyncio.run(r.choose_replicas([a, b], pr))[0][0].replica_id == replica_id
    r.on_request_routed(pr, replica_id, None)
    assert r._local(f"prefill#{chosen}") == (64, 1)


def test_a_call_that_carries_no_request_is_not_load():
    """`stats` calls (the gateway's /metrics asks each pool) go through the same
    router; they are not work a replica queues."""
    r = router()
    a = replica("a")
    r._sync([a])
    call = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="stats-1", call_method="stats"),
                           args=(), kwargs={})
    assert asyncio.run(r.choose_replicas([a], call))[0][0] is a
    r.on_request_routed(call, a.replica_id, None)
    assert r._local("prefill#a") == (0, 0) and r.pending() == 0


def test_the_decode_router_places_a_request_to_prefill_there_by_its_prompts_blocks():
    """A `PrefillRequest` sent to the decode pool (router.disaggregation) is placed as
    a handoff would be: on a replica with room for its prompt's blocks."""
    r = object.__new__(KVAwareDecodeRouter)
    r.initialize_state(block_size=BS, seed=0)
    tight = SimpleNamespace(replica_id=SimpleNamespace(deployment_id=SimpleNamespace(name="decode"), unique_id="a"),
                            routing_stats=RoutingStats(kv_blocks_free=4, kv_blocks_total=100).to_wire())
    roomy = SimpleNamespace(replica_id=SimpleNamespace(deployment_id=SimpleNamespace(name="decode"), unique_id="b"),
                            routing_stats=RoutingStats(kv_blocks_free=90, kv_blocks_total=100,
                                                       num_requests=3).to_wire())
    pr = pending([7] * (8 * BS))  # 8 blocks + 1 for the output: only b has room
    pr.metadata.call_method = "generate"
    ranked = asyncio.run(r.choose_replicas([tight, roomy], pr))
    assert ranked[0][0].replica_id.unique_id == "b"
    assert r._local("decode#b") == (9, 1)


def decode_replica(name: str, **stats) -> SimpleNamespace:
    rid = SimpleNamespace(deployment_id=SimpleNamespace(name="decode"), unique_id=name)
    return SimpleNamespace(replica_id=rid, routing_stats=RoutingStats(kv_blocks_free=90, kv_blocks_total=100)
                           .to_wire() | stats)


def decode_router() -> KVAwareDecodeRouter:
    r = object.__new__(KVAwareDecodeRouter)
    r.initialize_state(block_size=BS, model_fingerprint=FP, seed=0)
    return r


def test_a_prompt_to_prefill_on_decode_goes_where_its_prefix_is():
    """From the decode replicas' KV events: the replica holding a conversation's
    earlier turns computes the next one (if it has room); a handoff's DecodeRequest is
    placed by load alone."""
    r = decode_router()
    holder = decode_replica("a", kv_log=holding(PREFIX).window(), num_requests=4)
    idle = decode_replica("b")
    r._sync([holder, idle])
    pr = pending(PREFIX + [3] * 20)
    pr.metadata.call_method = "generate"
    ranked = asyncio.run(r.choose_replicas([holder, idle], pr))
    assert ranked[0][0].replica_id.unique_id == "a" and r.decisions["prefix"] == 1
    assert asyncio.run(r.local_view(pr.args[0])) == DecodeSide(len(PREFIX), 4, True)
    # A full holder is no place to compute it: the decode router's usual choice.
    full = decode_replica("a", kv_log=holding(PREFIX).window(), kv_blocks_free=2)
    r._sync([full, idle])
    assert asyncio.run(r.local_view(pending(PREFIX + [4] * 20).args[0])) == DecodeSide(0, 0, True)


def test_the_cluster_view_joins_both_routers():
    from routing.router import view

    async def run():
        p, d = router(), decode_router()
        p._sync([replica("p", queued_prefill_tokens=300), replica("q", queued_prefill_tokens=120)])
        d._sync([decode_replica("a", kv_log=holding(PREFIX[:8 * BS]).window(), num_requests=2)])
        view.register("prefill", p)
        view.register("decode", d)
        return await view.cluster_view(pending(PREFIX + [5] * 10).args[0])

    v = asyncio.run(run())
    assert (v.prefill_queued_tokens, v.prefill_cached_tokens) == (120, 0)
    assert (v.decode_cached_tokens, v.decode_running, v.decode_fits) == (8 * BS, 2, True)


def test_a_forked_choice_goes_where_its_sibling_runs_while_it_runs():
    """`PrefillRequest.fork_of`: the decode router sends the choice to the replica its
    sibling's call went to (whatever load says), and decides as usual once that call
    completed or that replica left."""
    import dataclasses

    r = decode_router()
    busy, idle = decode_replica("a", num_requests=6), decode_replica("b")
    sibling = pending([7] * 40)
    sibling.metadata.call_method = "generate"
    r.on_request_routed(sibling, busy.replica_id, None)  # the sibling's call runs on the busy one

    def fork() -> SimpleNamespace:
        pr = pending([7] * 40)
        pr.metadata.call_method = "generate"
        pr.args = (dataclasses.replace(pr.args[0], fork_of=sibling.args[0].request_id),)
        return pr

    ranked = asyncio.run(r.choose_replicas([busy, idle], fork()))
    assert [x[0].replica_id.unique_id for x in ranked] == ["a", "b"] and r.decisions["fork"] == 1
    r.on_request_completed(busy.replica_id, sibling.metadata.internal_request_id)
    ranked = asyncio.run(r.choose_replicas([busy, idle], fork()))
    assert ranked[0][0].replica_id.unique_id == "b" and r.decisions["fork"] == 1
    r.on_request_routed(sibling, busy.replica_id, None)
    r.remove_replica("decode#a")  # it left: the sibling's place is forgotten with it
    assert asyncio.run(r.choose_replicas([idle], fork()))[0][0].replica_id.unique_id == "b"
    assert r.decisions["fork"] == 1


def test_the_aggregated_router_spreads_a_burst_and_follows_the_prefix():
    """Two idle aggregated replicas whose reports say nothing yet: a burst of eight
    goes four and four (each decision sees those before it), and a prompt whose prefix
    one replica's KV events show goes there, under the aggregated pool's own name."""
    r = object.__new__(KVAwareAggregatedRouter)
    r.initialize_state(block_size=BS, model_fingerprint=FP, seed=0)

    def aggregated(name: str, **stats) -> SimpleNamespace:
        rid = SimpleNamespace(deployment_id=SimpleNamespace(name="aggregated"), unique_id=name)
        return SimpleNamespace(replica_id=rid, routing_stats=RoutingStats(kv_blocks_free=90, kv_blocks_total=100)
                               .to_wire() | stats)

    a, b = aggregated("a"), aggregated("b")
    r._sync([a, b])
    chosen = []
    for i in range(8):
        pr = pending([100 + i] * 40)
        pr.metadata.call_method = "generate"
        chosen.append(asyncio.run(r.choose_replicas([a, b], pr))[0][0].replica_id.unique_id)
    assert sorted(chosen) == ["a"] * 4 + ["b"] * 4
    assert r._local("aggregated#a")[1] == 4 and r.index_kind == "memory"

    holder = aggregated("b", kv_log=holding(PREFIX).window())
    r._sync([a, holder])
    pr = pending(PREFIX + [3] * 20)
    pr.metadata.call_method = "generate"
    assert asyncio.run(r.choose_replicas([a, holder], pr))[0][0].replica_id.unique_id == "b"
    assert r.decisions["prefix"] == 1


def test_a_pick_only_choice_counts_as_load_until_the_replicas_reports_can_count_it():
    """The ingress request router only picks (HAProxy sends the request, so this router
    never sees it sent or completed): a pick spreads the picks right after it, then
    stops counting, where the replica's own report takes over."""
    r = object.__new__(KVAwareAggregatedRouter)
    r.initialize_state(block_size=BS, model_fingerprint=FP, seed=0)
    a, b = (SimpleNamespace(replica_id=SimpleNamespace(deployment_id=SimpleNamespace(name="aggregated"), unique_id=n),
                            routing_stats=RoutingStats(kv_blocks_free=90, kv_blocks_total=100).to_wire())
            for n in "ab")
    r._sync([a, b])

    def pick(prompt: list[int]) -> str:
        pr = pending(prompt)
        pr.metadata.call_method = "generate"
        pr.kwargs = {PICK_ONLY: True}
        chosen = asyncio.run(r.choose_replicas([a, b], pr))[0][0].replica_id.unique_id
        # The picker reads back why, once (the chosen replica's request span says).
        decision = r.take_pick(pr.metadata.internal_request_id)
        assert decision is not None and decision.replica_id == f"aggregated#{chosen}" and decision.reason == "kv"
        assert r.take_pick(pr.metadata.internal_request_id) is None
        return chosen

    assert sorted(pick([200 + i] * 40) for i in range(4)) == ["a", "a", "b", "b"]
    assert r._local("aggregated#a")[1] == 2
    for rid, p in r._planned.items():  # the window passes
        r._planned[rid] = p.__class__(p.key, p.request_id, p.tokens, p.counted, p.expires_at - 60)
    assert r._local("aggregated#a") == (0, 0) and r._local("aggregated#b") == (0, 0)
    assert pick([300] * 40) == "a"  # both idle again: the stable tie-break


def test_a_replica_whose_engine_core_is_being_replaced_is_chosen_only_when_no_other_serves():
    """Its report says `serving: false`: the prefix it held is no reason to go there
    (the new engine's pool is empty, and a call fails until it is up)."""
    r = router()
    holder = replica("a", kv_log=holding(PREFIX).window(), serving=False)
    other = replica("b")
    r._sync([holder, other])
    pr = pending(PREFIX + [5] * 8)
    ranked = asyncio.run(r.choose_replicas([holder, other], pr))
    assert [[x.replica_id.unique_id for x in rank] for rank in ranked] == [["b"]]
    assert choose(r, [holder], PREFIX)[0] == "a"  # the only one: its caller fails fast and waits or retries
    d = decode_router()
    lost, live = decode_replica("a", serving=False), decode_replica("b", num_requests=9)
    d._sync([lost, live])
    call = pending(PREFIX)
    call.metadata.call_method = "generate"
    assert [[x.replica_id.unique_id for x in rank] for rank in asyncio.run(d.choose_replicas([lost, live], call))] \
        == [["b"]]
