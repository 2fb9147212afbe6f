"""The gateway's per-request deadline and header limits (pure logic, no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from routing.openai.access import check_headers
from routing.openai.errors import APIError
from routing.openai.pipeline import within

pytestmark = pytest.mark.unit


async def test_a_request_past_its_deadline_is_cancelled_and_cleaned_up():
    cleaned = []

    async def slow():
        try:
            yield 1
            await asyncio.sleep(30)
            yield 2
        finally:
            cleaned.append(True)

    got = []
    with pytest.raises(APIError) as e:
        async for x in within(slow(), 0.2):
            got.append(x)
    assert got == [1] and cleaned == [True]
    assert e.value.status == 504 and e.value.code == "timeout"


async def test_within_the_deadline_everything_passes_and_closing_early_cleans_up():
    cleaned = []

    async def quick():
        try:
            for i in range(3):
                yield i
        finally:
            cleaned.append(True)

    assert [x async for x in within(quick(), 5)] == [0, 1, 2]
    assert [x async for x in within(quick(), None)] == [0, 1, 2]
    gen = within(quick(), 5)
    assert await gen.__anext__() == 0
    await gen.aclose()  # the client left
    assert cleaned == [True, True, True]


def test_header_limits():
    ok = [(b"authorization", b"Bearer x"), (b"content-type", b"application/json")]
    check_headers(ok, 1024, 8)
    with pytest.raises(APIError) as e:
        check_headers(ok * 5, 1024, 8)
    assert e.value.status == 431 and "fields" in e.value.message
    with pytest.raises(APIError) as e:
        check_headers([(b"x-big", b"v" * 2000)], 1024, 8)
    assert e.value.status == 431 and "bytes" in e.value.message
