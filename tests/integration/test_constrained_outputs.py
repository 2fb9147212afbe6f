"""Structured outputs and `n` choices on a real disaggregated cluster (two replicas per
pool): 15 JSON-schema requests over 3 schemas, streamed and not, sampled and batched
together, each answer valid against its schema (jsonschema); a structured stream whose
decode replica loses its engine mid-stream migrates and still ends as the uninterrupted
document; `n` choices come back with the prompt counted once and every KV block free.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from duet_cluster import (
    engine_restarts,
    gateway_counter,
    kill_engine_core,
    live_replicas,
    serving_replica,
    wait_baseline,
    wait_for,
    wait_replicas,
)
from sse import data_events

from bench.structured import ASKS, MAX_TOKENS, SCHEMAS

pytestmark = [pytest.mark.integration, pytest.mark.cluster("resilient")]

def _body(name: str, i: int, stream: bool) -> dict:
    """Request `i` for a schema of `duet bench structured`: its strings and arrays are
    bounded, so every document fits in MAX_TOKENS and each request must end with "stop"
    (a complete document), sampled or not."""
    return {"messages": [{"role": "user", "content": f"{ASKS[name]} Answer in JSON. (#{i})"}],
            "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": i, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}}


def _chat(url: str, body: dict, on_chunk=None) -> tuple[str, str | None]:
    """(content, finish_reason) of one chat, streamed or not."""
    if not body["stream"]:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, finish, n = "", None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for event in data_events(r):
            choice = event["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
            n += 1
            if on_chunk is not None:
                on_chunk(n)
    return text, finish


def test_fifteen_schema_requests_all_validate(duet):
    jobs = [(name, i, i % 2 == 0) for name in SCHEMAS for i in range(5)]
    with ThreadPoolExecutor(8) as pool:  # batched with each other on both pools
        answers = list(pool.map(lambda job: (job[0], *_chat(duet.url, _body(*job))), jobs))
    for name, text, finish in answers:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len({text for _, text, _ in answers}) > 3  # sampled: not one answer repeated
    for pool_name in duet.pool_names():
        wait_baseline(duet, pool_name)


def test_a_structured_stream_survives_losing_its_decode_engine(duet):
    """The decode replica the request came in on loses its engine core mid-stream: the
    stream migrates to the other decode replica (never back to the one that lost its
    engine) and goes on under the same grammar, token for token as without the loss;
    the replica starts a new engine core in place (Serve does not replace it) and
    serves again."""
    wait_replicas("decode", 2)
    body = {**_body("employee", 0, True), "temperature": 0}
    reference, finish = _chat(duet.url, body)
    assert finish == "stop"
    before = gateway_counter(duet, "duet_migrations_total")
    killed: list[str] = []

    def kill_at_fifth(n: int) -> None:
        if n == 5 and not killed:
            replica = wait_for(lambda: serving_replica("decode"), 30, interval=0.05, what="the serving decode replica")
            kill_engine_core(replica)
            killed.append(replica)

    text, finish = _chat(duet.url, body, kill_at_fifth)
    assert killed, "the stream ended before its 5th chunk"
    assert (text, finish) == (reference, "stop")
    jsonschema.validate(json.loads(text), SCHEMAS["employee"])
    assert gateway_counter(duet, "duet_migrations_total") - before == 1
    restarted = wait_for(lambda: (s := engine_restarts(killed[0]))["engine_restarts"] >= 1 and s, 120,
                         what="the engine core restarted in place")
    assert restarted["engine_serving"] == 1 and restarted["engine_restart_failures"] == 0
    assert killed[0] in live_replicas("decode")  # the same replica, not a replacement
    wait_replicas("decode", 2)
    again, finish = _chat(duet.url, body)  # and the pool serves as before
    assert (again, finish) == (reference, "stop")


def test_n_choices_count_the_prompt_once_and_free_every_block(duet):
    body = {**_body("review", 3, False), "n": 3}
    r = httpx.post(f"{duet.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    for c in resp["choices"]:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMAS["review"])
    one = httpx.post(f"{duet.url}/v1/chat/completions", json={**body, "n": 1}, timeout=300).json()
    assert resp["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert resp["usage"]["completion_tokens"] > one["usage"]["completion_tokens"]
    for pool_name in duet.pool_names():
        wait_baseline(duet, pool_name)
