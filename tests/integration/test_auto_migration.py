"""`router.disaggregation: auto` when a request's prompt was prefilled on the decode
replica that is then lost: nothing else holds its KV, and the request migrates like
one that was handed off (prompt and streamed tokens computed again on a live replica),
with its greedy text unchanged and no lease left behind."""

from __future__ import annotations

import httpx
import pytest
from duet_cluster import (
    AUTO_RESILIENT_LOCAL_MAX_TOKENS,
    gateway_counter,
    kill_replica,
    prompt,
    serving_replica,
    wait_for,
    wait_idle,
    wait_replicas,
)
from sse import data_events

pytestmark = [pytest.mark.integration, pytest.mark.cluster("auto-resilient")]

# A few token ids: under the local limit, so `auto` prefills them on decode.
BODY = {"model": "smollm2-135m", "prompt": prompt(AUTO_RESILIENT_LOCAL_MAX_TOKENS - 4, 7701), "max_tokens": 160,
        "temperature": 0, "ignore_eos": True, "stream": True}


def _stream(duet, on_chunk=None) -> str:
    """The streamed completion's text; `on_chunk(n_chunks)` after each chunk with text."""
    text, n = "", 0
    with httpx.stream("POST", f"{duet.url}/v1/completions", json=BODY, timeout=300) as r:
        assert r.status_code == 200
        for event in data_events(r):
            piece = event["choices"][0].get("text") if event.get("choices") else None
            if piece:
                text += piece
                n += 1
                if on_chunk is not None:
                    on_chunk(n)
    return text


def test_a_request_prefilled_on_its_lost_decode_replica_migrates(duet):
    wait_replicas("decode", 2)
    reference = _stream(duet)
    local = gateway_counter(duet, "duet_disaggregation_decisions_total", where="local")
    migrations = gateway_counter(duet, "duet_migrations_total")
    leases = duet.stats("prefill")["leases_granted"]
    at_kill: dict[str, int] = {}

    def kill_at_tenth(n: int) -> None:
        if n == 10 and not at_kill:
            replica = wait_for(lambda: serving_replica("decode"), 30, interval=0.05, what="the serving decode replica")
            at_kill["leases"] = duet.stats("prefill")["leases_granted"]
            kill_replica(replica)

    text = _stream(duet, kill_at_tenth)
    assert at_kill, "the stream ended before its 10th chunk"
    assert at_kill["leases"] == leases  # its first pass was prefilled on decode: no handoff
    assert gateway_counter(duet, "duet_disaggregation_decisions_total", where="local") > local
    assert gateway_counter(duet, "duet_migrations_total") - migrations == 1
    assert text == reference
    wait_replicas("decode", 2)
    wait_idle(duet, timeout=60)
