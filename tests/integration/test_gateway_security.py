"""The gateway's API keys and limits on a real cluster: 401 without the right key on
every generation endpoint, 413 for a body over the cap, 431 for too many headers, 429
with Retry-After for a key's second request in flight and for its token budget, 504
past the request deadline (with everything it held freed); CORS only for the
configured origin; probes stay open; no refused request costs a KV block; and under
`cache_isolation: per_key` one key's cached prompt is no hit for another key."""

from __future__ import annotations

import json

import httpx
import pytest
from duet_cluster import (
    API_KEYS,
    CORS_ORIGIN,
    MAX_BODY_BYTES,
    REQUEST_TIMEOUT_S,
    TOKENS_PER_MINUTE,
    wait_for,
    wait_idle,
)

pytestmark = [pytest.mark.integration, pytest.mark.cluster("secure")]

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
KEY_A, KEY_B, KEY_C, KEY_D = API_KEYS


def _post(duet, path: str, body: dict, key: str | None = None, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{duet.url}{path}", json=body, headers=headers, timeout=120, **kw)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_generation_needs_a_right_key(duet, path, body):
    for key in (None, "sk-wrong", KEY_A + "x"):
        r = _post(duet, path, body, key)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = _post(duet, path, body, KEY_A)
    assert r.status_code == 200, r.text


def test_models_need_a_key_and_probes_do_not(duet):
    assert httpx.get(f"{duet.url}/v1/models", timeout=30).status_code == 401
    r = httpx.get(f"{duet.url}/v1/models", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert r.status_code == 200
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{duet.url}{probe}", timeout=30).status_code == 200, probe


def test_a_body_over_the_cap_is_a_413(duet):
    big = {**COMPLETION, "prompt": "word " * MAX_BODY_BYTES}
    r = _post(duet, "/v1/completions", big, KEY_A)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_a_second_request_in_flight_for_one_key_is_a_429(duet):
    body = {**COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {KEY_B}"}
    with httpx.stream("POST", f"{duet.url}/v1/completions", json=body, headers=headers, timeout=120) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # the first request is generating now
        second = _post(duet, "/v1/completions", COMPLETION, KEY_B)
        assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1, second.text
        assert _post(duet, "/v1/completions", COMPLETION, KEY_A).status_code == 200  # other keys go on
    wait_idle(duet)


def test_the_token_budget_per_minute_is_a_429(duet):
    """The budget is charged at admission (prompt + max_tokens), so the first request
    need not run to its end (a 990-token generation, or prefill, could outlast the
    config's 10 s deadline on a busy machine): it is charged, streams its first chunk,
    and is dropped."""
    body = {"prompt": "Count to ten:", "max_tokens": 990, "temperature": 0}
    headers = {"authorization": f"Bearer {KEY_C}"}
    with httpx.stream("POST", f"{duet.url}/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as first:
        assert first.status_code == 200
        next(first.iter_lines())

    def second() -> httpx.Response | None:  # the key's one request slot is back once the gateway saw the hang-up
        r = _post(duet, "/v1/completions", body, KEY_C)
        return None if r.status_code == 429 and "in flight" in r.text else r

    r = wait_for(second, 30, interval=0.2, what="the dropped request's slot freed")
    assert r.status_code == 429, r.text
    assert "Token budget" in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) > 10  # ~950 tokens short at 1,100 a minute
    assert 4 + 990 <= TOKENS_PER_MINUTE  # the first (4 prompt tokens) fitted: the budget refused the second
    wait_idle(duet)


def test_refused_requests_cost_no_kv_block(duet):
    for _ in range(3):
        assert _post(duet, "/v1/chat/completions", CHAT, "sk-wrong").status_code == 401
        big = {**COMPLETION, "prompt": "word " * MAX_BODY_BYTES}
        assert _post(duet, "/v1/completions", big, KEY_A).status_code == 413
    wait_idle(duet)
    for pool in duet.pool_names():
        assert duet.stats(pool)["leases_active" if pool == "prefill" else "num_running"] == 0


def test_too_many_headers_is_a_431(duet):
    headers = {"authorization": f"Bearer {KEY_A}", **{f"x-pad-{i}": "1" for i in range(60)}}
    r = httpx.post(f"{duet.url}/v1/completions", json=COMPLETION, headers=headers, timeout=60)
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large", r.text


def test_cors_answers_the_configured_origin_only(duet):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    ok = httpx.options(f"{duet.url}/v1/chat/completions", headers={"origin": CORS_ORIGIN, **preflight}, timeout=30)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == CORS_ORIGIN
    other = httpx.options(f"{duet.url}/v1/chat/completions", headers={"origin": "https://evil.example", **preflight},
                          timeout=30)
    assert "access-control-allow-origin" not in other.headers


def test_a_request_past_its_deadline_ends_with_a_504_and_frees_everything(duet):
    body = {**COMPLETION, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{duet.url}/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY_D}"}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-1])["error"]
    assert error["code"] == "timeout" and f"{REQUEST_TIMEOUT_S:g} s" in error["message"]
    wait_idle(duet)


def test_one_keys_cached_prompt_is_no_hit_for_another_key(duet):
    """`cache_isolation: per_key`: the same prompt is cached per key, so a second key
    sees a cold prefill (no timing difference to learn from); a `cache_salt` narrows a
    key's namespace further."""
    body = {"prompt": list(range(2000, 2080)), "max_tokens": 2, "temperature": 0}  # 5 blocks of 16

    def cached(key: str, **fields) -> tuple[int, str]:
        r = _post(duet, "/v1/completions", {**body, **fields}, key)
        assert r.status_code == 200, r.text
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0, r.json()["choices"][0]["text"]

    first, text = cached(KEY_A)
    assert first == 0
    assert cached(KEY_A) == (64, text)  # the key's own repeat: 4 of 5 blocks (the last token is computed)
    assert cached(KEY_B) == (0, text)
    assert cached(KEY_A, cache_salt="project-2") == (0, text)
