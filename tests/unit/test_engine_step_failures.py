"""An exception inside an engine step fails the request that causes it, alone; the
engine and every other request go on (and a broken engine still stops)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine, RequestFailed
from engine.engine import MAX_FAILED_STEPS
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
POISON = "poison"


def poison_forward(engine) -> None:
    """The forward raises whenever the poisoned request is in the batch (a fault the
    validation did not foresee)."""
    real = engine.runner.execute

    def execute(sched):
        if any(s.request.request_id == POISON for s in sched.scheduled):
            raise RuntimeError("Overflow when unpacking long long")
        return real(sched)

    engine.runner.execute = execute


def drain(engine) -> dict:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_failing_request_fails_alone_in_a_shared_batch(make_engine):
    ref = make_engine()
    ref.add_request("The capital of France is", GREEDY, request_id="ok")
    expected = tokens(drain(ref)["ok"])

    e = make_engine()
    poison_forward(e)
    e.add_request("The capital of France is", GREEDY, request_id="ok")
    e.add_request("Hello there", GREEDY, request_id=POISON)
    outs = drain(e)
    assert tokens(outs["ok"]) == expected
    bad = outs[POISON][-1]
    assert bad.finished and bad.finish_reason == FinishReason.ABORT and "Overflow" in bad.error
    assert e.block_pool.num_free_blocks == e.block_pool.num_blocks  # cached blocks count as free
    # and it goes on serving
    e.add_request("The capital of France is", GREEDY, request_id="again")
    assert tokens(drain(e)["again"]) == expected


def test_a_failing_sampler_fails_only_its_request(make_engine):
    e = make_engine()
    real = e.sampler

    def sampler(logits, reqs):
        if any(r.request_id == POISON for r in reqs):
            raise ValueError("bad sampling state")
        return real(logits, reqs)

    e.sampler = sampler
    e.add_request("The capital of France is", GREEDY, request_id="ok")
    e.add_request("Hello there", GREEDY, request_id=POISON)
    outs = drain(e)
    assert len(tokens(outs["ok"])) == GREEDY.max_tokens
    assert "bad sampling state" in outs[POISON][-1].error


def test_an_engine_that_fails_every_step_stops(make_engine):
    e = make_engine()

    def broken(sched):
        raise RuntimeError("device lost")

    e.runner.execute = broken
    for i in range(MAX_FAILED_STEPS - 1):
        e.add_request("Hi", GREEDY, request_id=f"r{i}")
        assert drain(e)[f"r{i}"][-1].error
    e.add_request("Hi", GREEDY, request_id="last")
    with pytest.raises(RuntimeError, match="in a row"):
        drain(e)


async def test_the_async_engine_fails_the_stream_and_keeps_serving(make_engine):
    e = make_engine()
    poison_forward(e)
    ae = AsyncEngine(e)
    try:
        async def run(rid: str, prompt: str) -> list[int]:
            stream = await ae.add(rid, lambda: e.add_request(prompt, GREEDY, request_id=rid))
            return [t async for outs in stream for o in outs for t in o.new_token_ids]

        ok, bad = await asyncio.gather(run("ok", "The capital of France is"), run(POISON, "Hello"),
                                       return_exceptions=True)
        assert isinstance(bad, RequestFailed) and "Overflow" in str(bad)
        assert len(ok) == GREEDY.max_tokens
        ae.check_health()
        assert len(await run("after", "Hi")) == GREEDY.max_tokens
    finally:
        ae.shutdown()


async def test_an_add_cancelled_while_queued_never_starts_and_one_cancelled_after_start_is_aborted(make_engine):
    e = make_engine()
    ae = AsyncEngine(e)
    total = e.block_pool.num_free_blocks
    try:
        # Queued behind a busy engine thread, then cancelled: the engine skips the
        # command, so `start` never runs (what its caller holds is still the caller's).
        gate, busy, started = threading.Event(), threading.Event(), []
        ae.submit(lambda: (busy.set(), gate.wait(30)))
        assert await asyncio.to_thread(busy.wait, 30)
        task = asyncio.create_task(ae.add("queued", lambda: started.append(1)))
        for _ in range(3000):  # the add's command is queued behind the busy one
            if not ae._commands.empty():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # the cancel has reached the queued command before the engine is free
        gate.set()
        await ae.call(lambda: None)
        assert started == []

        # Cancelled while the answer of a command that ran is on its way: the request is
        # in the engine with nobody to read it, and is aborted at once.
        loop = asyncio.get_running_loop()

        def start():
            e.add_request("The capital of France is", GREEDY, request_id="orphan")
            loop.call_soon_threadsafe(task.cancel)

        task = asyncio.create_task(ae.add("orphan", start))
        with pytest.raises(asyncio.CancelledError):
            await task
        # Read on the engine thread, after the abort (its final output may still be queued).
        left = await ae.call(lambda: (e.scheduler.has_unfinished(), e.block_pool.num_free_blocks))
        assert left == (False, total)
    finally:
        ae.shutdown()
