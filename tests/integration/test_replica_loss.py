"""Lost and stopped replicas on a real cluster: requests sent right after a prefill
replica is killed are served by the other one; a decode replica removed by a
scale-down hands its streams on with their KV (moved, not migrated), and keeps
streaming them to its clients as their ingress.

A decode replica killed outright takes its clients' connections with it (it is their
HTTP ingress): test_failures.py checks that such a stream ends with an error, never a
hang, and that nothing leaks."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from duet_cluster import (
    kill_replica,
    live_replicas,
    ongoing_requests,
    wait_baseline,
    wait_for,
    wait_idle,
    wait_replicas,
)
from sse import data_events

pytestmark = [pytest.mark.integration, pytest.mark.cluster("resilient")]

CHAT = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}], "max_tokens": 160,
        "temperature": 0, "ignore_eos": True, "stream": True}
# Long enough to be decoding still when the resize it outlives starts.
LONG_CHAT = {**CHAT, "max_tokens": 400}


def _stream(duet, on_chunk=None, chat: dict = CHAT) -> tuple[str, list[dict]]:
    """(text, events) of one streamed chat; `on_chunk(id, n_chunks)` after each content chunk."""
    text, events, n = "", [], 0
    with httpx.stream("POST", f"{duet.url}/v1/chat/completions", json=chat, timeout=300) as r:
        assert r.status_code == 200
        for event in data_events(r):
            events.append(event)
            delta = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if delta:
                text += delta
                n += 1
                if on_chunk is not None:
                    on_chunk(event["id"], n)
    return text, events


def test_requests_right_after_a_prefill_replica_dies_are_served(duet):
    wait_replicas("prefill", 2)
    victim = duet.stats("prefill")["replica_id"]
    kill_replica(victim)
    t0 = time.monotonic()
    for i in range(4):
        body = {**CHAT, "stream": False, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"Say the number {i}."}]}
        r = httpx.post(f"{duet.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, (i, time.monotonic() - t0, r.text)
    wait_replicas("prefill", 2)
    wait_idle(duet, timeout=60)


def test_scaling_down_moves_the_stopped_replicas_sequences_with_their_kv(deployer, duet):
    """Resizing a fixed pool is Serve's lightweight update (cluster/serve_config.py): the
    removed replica drains, hands its decoding sequence to the other replica with its
    KV (no prefill, nothing recomputed, the greedy text unchanged), and no other
    replica is restarted. The two streams are the same greedy request and only one of
    them moves: the other, decoded where it started, is the reference."""
    # The whole cluster at its size first: a replica an earlier test killed may still be
    # being replaced (or its actor still exiting), and "no other replica is restarted"
    # compares the live actors before and after the resize.
    for pool, n in (("prefill", 2), ("decode", 2)):
        wait_replicas(pool, n, exact=True)
        wait_for(lambda pool=pool, n=n: len(live_replicas(pool)) == n, 60, what=f"{n} live {pool} actors")
    before = {pool: live_replicas(pool) for pool in ("prefill", "decode")}
    granted = _prefill_leases_granted(duet)
    texts: dict[int, str] = {}
    started = [threading.Event(), threading.Event()]

    def client(i: int) -> None:
        # Started once its second chunk arrives: the first is prefill's token, and until
        # decode's engine makes the second the sequence may still be importing its KV
        # (under load, for seconds), which a draining replica finishes where it is.
        texts[i], _ = _stream(duet, lambda rid, n: n >= 2 and started[i].set(), chat=LONG_CHAT)

    # One stream per decode replica: the router sends the second where nothing runs.
    threads = []
    for i in range(2):
        threads.append(threading.Thread(target=client, args=(i,)))
        threads[-1].start()
        assert started[i].wait(120)
    # A stats call may be in flight beside a stream for a moment: wait it out.
    wait_for(lambda: sorted(ongoing_requests("decode").values()) == [1, 1], 30,
             what="one stream on each decode replica")
    assert all(t.is_alive() for t in threads)  # both still decoding as the resize starts
    smaller = deployer("resilient", {"decode.replicas": 1})  # returns once one decode replica is left
    for t in threads:
        t.join(300)
    assert len(texts) == 2 and texts[0] == texts[1] and len(texts[0]) > 0
    # Moved, not lost: nothing prefilled again (a migration would have been a third
    # prefill). The move's counter lived in the drained replica, its stream's ingress.
    assert _prefill_leases_granted(smaller) == granted + 2
    # Serve counts a replica stopped once it asked Ray to kill it; the actor may linger.
    wait_for(lambda: len(live_replicas("decode")) == 1, 30, what="one decode actor left")
    after = {pool: live_replicas(pool) for pool in ("prefill", "decode")}
    assert after["prefill"] == before["prefill"]
    assert len(after["decode"]) == 1 and after["decode"] < before["decode"]
    (survivor,) = wait_baseline(smaller, "decode").values()
    assert survivor["import_blocks_held"] == 0 and survivor["leases_active"] == 0
    wait_idle(smaller, timeout=60)


def _prefill_leases_granted(duet) -> int:
    return sum(s["leases_granted"] for s in wait_baseline(duet, "prefill").values())
