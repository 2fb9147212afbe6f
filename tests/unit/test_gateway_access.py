"""API keys and per-key limits of the gateway, as pure code over a fake clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from routing.openai.access import ANONYMOUS, APIKeys, KeyLimiter, key_id, read_body
from routing.openai.errors import APIError

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _status(fn) -> APIError:
    with pytest.raises(APIError) as err:
        fn()
    return err.value


def test_no_key_configured_means_an_open_gateway():
    keys = APIKeys.load(None, env={})
    assert not keys.enabled and keys.authenticate(None) == ANONYMOUS


def test_keys_from_the_environment_and_a_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team a\nsk-file-1\n\nsk-file-2  # rotated monthly\n")
    keys = APIKeys.load(str(f), env={"DUET_API_KEYS": "sk-env-1, sk-env-2,"})
    assert len(keys) == 4
    assert keys.authenticate("Bearer sk-env-2") == key_id("sk-env-2")
    assert keys.authenticate("bearer sk-file-2") == key_id("sk-file-2")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Bearer sk-wrong", "Basic sk-env-1", "sk-env-1"])
def test_a_missing_or_wrong_key_is_a_401_in_openai_format(header):
    keys = APIKeys(["sk-env-1"])
    err = _status(lambda: keys.authenticate(header))
    assert err.status == 401 and err.code == "invalid_api_key" and err.body()["error"]["type"]


def test_requests_in_flight_per_key():
    lim = KeyLimiter(max_in_flight=2)
    lim.acquire("a")
    lim.acquire("a")
    err = _status(lambda: lim.acquire("a"))
    assert err.status == 429 and err.headers["Retry-After"] == "1"
    lim.acquire("b")  # another key is not affected
    lim.release("a")
    lim.check("a")
    lim.acquire("a")
    assert lim.in_flight("a") == 2


def test_token_budget_is_a_bucket_refilled_over_the_minute():
    clock = Clock()
    lim = KeyLimiter(tokens_per_minute=600, clock=clock)  # 10 tokens per second
    lim.charge("a", 500)
    err = _status(lambda: lim.charge("a", 300))  # 100 left: 200 short = 20 s
    assert err.status == 429 and err.headers["Retry-After"] == "20"
    clock.t += 20
    lim.charge("a", 300)  # refused charges took nothing
    clock.t += 3600
    lim.charge("a", 600)  # refills to the cap, not beyond
    assert _status(lambda: lim.charge("a", 1)).status == 429


def test_a_request_larger_than_the_whole_budget_says_so():
    err = _status(lambda: KeyLimiter(tokens_per_minute=100).charge("a", 101))
    assert err.status == 429 and "101 tokens" in err.message


def _request(body: bytes, declared: bool = True):
    async def stream():
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    headers = {"content-length": str(len(body))} if declared else {}
    return SimpleNamespace(headers=headers, stream=stream)


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_cap_is_a_413(declared):
    err = _status(lambda: asyncio.run(read_body(_request(b"x" * 5000, declared), 4096)))
    assert err.status == 413
    assert asyncio.run(read_body(_request(b"y" * 4096, declared), 4096)) == b"y" * 4096
