"""The aggregated pool's KV-aware router on a real Serve app (the "aggregated" cluster
resized to two replicas): a prompt's next turn is computed on the replica that holds
the first (its cached tokens say so; with either replica picked at random, six in a
row would all hit one time in 64), and a burst of distinct prompts reaches both."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from duet_cluster import BLOCK_SIZE, Duet, cached_tokens, complete, gateway_counter, live_replicas, prompt, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cluster("aggregated")]

HELD_BLOCKS = 4


@pytest.fixture(scope="module")
def two(deployer) -> Duet:
    return deployer("aggregated", {"aggregated.replicas": 2})


def _each_replica(duet: Duet) -> dict[str, dict]:
    """Every live aggregated replica's stats (a stats call lands on any one of them)."""
    seen: dict[str, dict] = {}

    def all_seen() -> bool:
        s = duet.stats("aggregated")
        seen[s["replica_id"]] = s
        return live_replicas("aggregated") <= seen.keys()

    wait_for(all_seen, 60, interval=0.05, what="stats from every aggregated replica")
    return {rid: s for rid, s in seen.items() if rid in live_replicas("aggregated")}


def _router_caught_up(duet: Duet) -> None:
    """The gateway's aggregated router has applied every replica's KV events so far."""
    seqs = {rid: s["kv_events_seq"] for rid, s in _each_replica(duet).items()}

    def applied() -> bool:
        return all(gateway_counter(duet, "duet_router_kv_events_seq", pool="aggregated", replica=rid) >= seq
                   for rid, seq in seqs.items())

    wait_for(applied, 30, what=f"the gateway's aggregated router to apply the KV events of {sorted(seqs)}")


def test_a_prompts_next_turn_goes_to_the_replica_holding_it(two):
    for i in range(6):
        first = prompt(HELD_BLOCKS * BLOCK_SIZE + 3, 9300 + i)
        complete(two, first, max_tokens=1)
        _router_caught_up(two)
        body = complete(two, first + prompt(8, 9400 + i), max_tokens=1)
        assert cached_tokens(body) == HELD_BLOCKS * BLOCK_SIZE, f"turn {i}"


def test_a_burst_of_distinct_prompts_reaches_both_replicas(two):
    before = {rid: s["prefix_cache_queried_tokens"] for rid, s in _each_replica(two).items()}
    assert len(before) == 2
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: complete(two, prompt(40, 9500 + i), max_tokens=4), range(8)))
    after = {rid: s["prefix_cache_queried_tokens"] for rid, s in _each_replica(two).items()}
    assert all(after[rid] > before[rid] for rid in before), (before, after)
