"""Failure paths on a real cluster: client disconnects, many concurrent streams, and
replicas killed mid-request past the gateway's limits (this cluster allows no
migration and no prefill retry: a stream whose decode replica, its ingress, dies gets
a clear error; a request whose only prefill replica dies is prefilled where it
decodes; surviving a lost replica is tests/integration/test_replica_loss.py). Nothing
hangs and no KV block leaks."""

from __future__ import annotations

import asyncio
import threading
import uuid

import httpx
import openai
import pytest
from duet_cluster import gateway_counter, kill_replica, live_replicas, wait_for, wait_idle

from engine.tokenizer import load_tokenizer
from engine.weights import SMOLLM2_ID

pytestmark = [pytest.mark.integration, pytest.mark.cluster("nixl")]

CLIENT_TIMEOUT = 60


def client(duet, timeout: float = CLIENT_TIMEOUT) -> openai.OpenAI:
    return openai.OpenAI(base_url=duet.base_url, api_key="unused", max_retries=0, timeout=timeout)


def single_replica(deployment: str) -> str:
    """The id of the single Serve replica of one deployment of the duet app."""
    ids = live_replicas(deployment)
    assert len(ids) == 1, ids
    (replica_id,) = ids
    return replica_id


def wait_replaced(duet, deployment: str, old_name: str) -> None:
    def replaced():
        name = single_replica(deployment)
        return name != old_name and duet.stats(deployment)["kv_blocks_total"] > 0

    wait_for(replaced, timeout=180, interval=1.0, what=f"Serve to replace the {deployment} replica")


def test_client_disconnect_mid_stream_frees_kv_on_both_sides(duet):
    wait_idle(duet)
    body = {
        "model": SMOLLM2_ID, "prompt": f"[{uuid.uuid4().hex}] Tell me a long story.", "max_tokens": 400,
        "temperature": 0, "ignore_eos": True, "stream": True,
    }
    with httpx.Client(base_url=duet.url, timeout=CLIENT_TIMEOUT) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events >= 4:  # first token from prefill, then decode's batches
                        break
    p = duet.stats("prefill")
    assert p["leases_granted"] >= 1
    wait_idle(duet, timeout=30)
    assert duet.stats("decode")["num_running"] == 0


def test_clients_leaving_right_after_the_first_token_leak_nothing(duet):
    """The first token comes from prefill; leaving then cancels decode while it may be
    importing the KV. The import finishes on its own, its blocks are freed, and the
    gateway rejects the lease: both sides back at baseline well before the lease TTL."""
    wait_idle(duet)
    body = {"model": SMOLLM2_ID, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=duet.url, timeout=CLIENT_TIMEOUT) as h:
        for i in range(6):
            prompt = f"[{uuid.uuid4().hex}] Request {i}: " + "tell me about the sea. " * (10 * i + 1)
            with h.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
                assert r.status_code == 200
                next(line for line in r.iter_lines() if line.startswith("data: "))
    assert duet.cfg.transfer.lease_ttl_s > 20
    wait_idle(duet, timeout=20)


async def _concurrent_streams(duet, n: int, max_tokens: int) -> list[tuple[str, str | None, int]]:
    # A stream that stalls fails at the client's timeout (APITimeoutError): "completes" is
    # every stream ending by itself, however slowly this machine runs them.
    c = openai.AsyncOpenAI(base_url=duet.base_url, api_key="unused", max_retries=0, timeout=180)

    async def one(i: int):
        text, finish, usage = "", None, None
        stream = await c.completions.create(
            model=SMOLLM2_ID, prompt=f"Request {i}: the number after {i} is", max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
        )
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        return text, finish, usage.completion_tokens if usage else 0

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await c.close()


def test_32_concurrent_streams_complete_without_leaking_blocks(duet):
    wait_idle(duet)
    before = duet.stats("prefill")
    results = asyncio.run(_concurrent_streams(duet, 32, max_tokens=16))
    for _text, finish, n_tokens in results:
        assert finish in ("stop", "length")
        assert 1 <= n_tokens <= 16
        assert finish == "stop" or n_tokens == 16
    wait_idle(duet, timeout=30)
    p = duet.stats("prefill")
    granted = p["leases_granted"] - before["leases_granted"]
    assert granted == sum(1 for _, finish, n in results if n > 1)  # ended at prefill: no lease
    assert p["leases_released"] - before["leases_released"] == granted


def _stream_in_thread(duet, **kw) -> tuple[threading.Thread, dict]:
    """Run one streaming completion in a thread; the dict gets chunks, error and done."""
    out: dict = {"chunks": 0, "error": None, "done": False}

    def run():
        try:
            for _chunk in client(duet).completions.create(model=SMOLLM2_ID, temperature=0, stream=True, **kw):
                out["chunks"] += 1
            out["done"] = True
        except Exception as e:  # what the test asserts on
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_decode_replica_killed_mid_stream(duet):
    wait_idle(duet)
    t, out = _stream_in_thread(
        duet, prompt=f"[{uuid.uuid4().hex}] Write a long essay.", max_tokens=600, extra_body={"ignore_eos": True}
    )
    wait_for(lambda: out["chunks"] >= 3 or out["error"], timeout=60, interval=0.05, what="the stream to start")
    assert out["error"] is None
    name = single_replica("decode")
    kill_replica(name)
    t.join(CLIENT_TIMEOUT + 10)
    assert not t.is_alive(), "the client hung after its decode replica died"
    assert not out["done"] and isinstance(out["error"], openai.APIError), out
    # Ended by the server's error, not by the client giving up on a silent stream.
    assert not isinstance(out["error"], openai.APITimeoutError), out

    wait_replaced(duet, "decode", name)
    r = client(duet, timeout=120).completions.create(model=SMOLLM2_ID, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    wait_idle(duet, timeout=30)


def test_a_request_whose_only_prefill_replica_dies_is_prefilled_where_it_decodes(duet):
    wait_idle(duet)
    # ~1000 tokens: two 512-token prefill chunks, a window of a second or more.
    text = f"[{uuid.uuid4().hex}] " + " ".join(f"w{i}" for i in range(1000))
    prompt = load_tokenizer(duet.cfg.engine.model).encode(text)[:1000]
    p0 = duet.stats("prefill")
    local0 = gateway_counter(duet, "duet_disaggregation_decisions_total", where="local", reason="prefill_unavailable")
    t, out = _stream_in_thread(duet, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})

    def in_prefill() -> bool:
        s = duet.stats("prefill")
        assert s["leases_granted"] == p0["leases_granted"], "prefill finished before the kill"
        return s["num_running"] + s["num_waiting"] > 0

    wait_for(in_prefill, timeout=60, interval=0.02, what="the prompt to reach prefill")
    name = single_replica("prefill")
    kill_replica(name)
    t.join(CLIENT_TIMEOUT + 10)
    assert not t.is_alive(), "the client hung after its prefill replica died"
    # No retry is allowed and no other prefill replica exists: the decode replica
    # computed the prompt itself, and says so.
    assert out["done"] and out["error"] is None and out["chunks"] == 8, out
    assert gateway_counter(duet, "duet_disaggregation_decisions_total", where="local",
                           reason="prefill_unavailable") == local0 + 1

    wait_replaced(duet, "prefill", name)
    r = client(duet, timeout=120).completions.create(model=SMOLLM2_ID, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    wait_idle(duet, timeout=30)
