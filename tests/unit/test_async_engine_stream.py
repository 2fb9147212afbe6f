"""`stream_interval`: how many outputs one streamed item carries (engine/async_engine.py)."""

from __future__ import annotations

import pytest

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)


async def _items(make_engine, interval: int) -> list[list]:
    e = make_engine(stream_interval=interval)
    ae = AsyncEngine(e)
    try:
        stream = await ae.add("r", lambda: e.add_request("The capital of France is", GREEDY, request_id="r"))
        return [outs async for outs in stream]
    finally:
        ae.shutdown()


@pytest.mark.parametrize("interval", [1, 4])
async def test_items_carry_at_least_the_interval_after_the_first_and_the_tokens_are_the_same(make_engine, interval):
    items = await _items(make_engine, interval)
    tokens = [t for outs in items for o in outs for t in o.new_token_ids]
    assert len(tokens) == GREEDY.max_tokens
    assert items[-1][-1].finished and not any(o.finished for outs in items for o in outs[:-1])
    # The first item goes out alone when it is ready (its first output is the first
    # token); each later one waits for `interval` outputs, except the stream's end.
    assert items[0][0].new_token_ids
    assert all(len(outs) >= interval for outs in items[1:-1])
    reference = await _items(make_engine, 1)
    assert tokens == [t for outs in reference for o in outs for t in o.new_token_ids]


def test_the_interval_is_validated():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
