"""A decode replica waits for KV blocks an import could fit in (decode/server.py
`reserve_when_free`), and refuses at once one that never could."""

import asyncio

import pytest

from decode.server import reserve_when_free

pytestmark = pytest.mark.unit


class Pool:
    """Full for the first `full_for` calls, then hands out blocks."""

    def __init__(self, full_for: int) -> None:
        self.calls = 0
        self.full_for = full_for

    async def reserve(self):
        self.calls += 1
        return None if self.calls <= self.full_for else [7, 8]


def test_a_full_pool_that_could_fit_the_prompt_is_waited_for():
    pool = Pool(full_for=3)
    assert asyncio.run(reserve_when_free(pool.reserve, could_fit=True, wait_s=5.0, first_delay_s=0.001)) == [7, 8]
    assert pool.calls == 4


def test_a_prompt_larger_than_the_pool_is_refused_at_once():
    pool = Pool(full_for=10**6)
    assert asyncio.run(reserve_when_free(pool.reserve, could_fit=False, wait_s=5.0)) is None
    assert pool.calls == 1


def test_the_wait_ends_with_the_time_the_lease_leaves():
    pool = Pool(full_for=10**6)
    assert asyncio.run(reserve_when_free(pool.reserve, could_fit=True, wait_s=0.05, first_delay_s=0.001,
                                         max_delay_s=0.01)) is None
    assert 2 <= pool.calls < 100
    assert asyncio.run(reserve_when_free(Pool(10**6).reserve, could_fit=True, wait_s=-1.0)) is None  # no time left
