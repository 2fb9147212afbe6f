"""The engine core in its own process (engine/core_process.py, engine/core_client.py):
the same tokens as the engine on a thread, bad input refused without harm, aborts that
free blocks, and a child that dies with its replica and fails its health check."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine, EngineDead
from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput

pytestmark = [pytest.mark.unit, pytest.mark.model]

CFG = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=512)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, *range(100 + 7 * i, 140 + 7 * i)] for i in range(4)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def core():
    client = EngineCoreClient(CFG, "aggregated", threads=1, kv_events=True)
    yield client
    client.shutdown()


async def _tokens(engine, request_id: str, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[int]:
    stream = await engine.add_request(request_id, prompt, sampling)
    return [t async for outs in stream for o in outs for t in o.new_token_ids]


async def _wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


async def _on_a_thread(make_engine) -> list[list[int]]:
    """PROMPTS' greedy tokens from the engine on a thread of this process."""
    ae = AsyncEngine(make_engine())
    try:
        return [await _tokens(ae, f"t{i}", p) for i, p in enumerate(PROMPTS)]
    finally:
        ae.shutdown()


async def test_concurrent_greedy_requests_match_the_engine_on_a_thread(core, make_engine):
    got = await asyncio.gather(*[_tokens(core, f"p{i}", p) for i, p in enumerate(PROMPTS)])
    assert got == await _on_a_thread(make_engine) and all(len(t) == GREEDY.max_tokens for t in got)
    # One message per step carries the stats and the KV events the replica publishes.
    await _wait_for(lambda: core.stats.num_requests == 0)
    assert core.stats.kv_blocks_total == 512 and core.take_kv_events()


async def test_a_child_that_shares_its_cores_with_a_busy_neighbour_generates_the_same_tokens(make_engine):
    """`engine.share_cores`: the child resizes its team before each step and between
    layers while a neighbour on the machine's table turns busy and idle. The tokens do
    not depend on the team."""
    from engine.core_share import CoreShare

    neighbour = CoreShare(max_threads=1)
    client = EngineCoreClient(CFG.replace(share_cores=True), "aggregated", threads=2)
    stop = asyncio.Event()

    async def flip() -> None:
        for i in range(100_000):  # bounded: the generation below ends long before
            if stop.is_set():
                return
            neighbour.busy() if i % 2 == 0 else neighbour.idle()
            await asyncio.sleep(0.001)

    flipping = asyncio.create_task(flip())
    try:
        got = await asyncio.gather(*[_tokens(client, f"s{i}", p) for i, p in enumerate(PROMPTS)])
    finally:
        stop.set()
        await flipping
        client.shutdown()
        neighbour.close()
    assert got == await _on_a_thread(make_engine) and all(len(t) == GREEDY.max_tokens for t in got)


async def test_bad_input_is_refused_by_name_and_the_others_carry_on(core):
    good = asyncio.create_task(_tokens(core, "ok", PROMPTS[0]))
    with pytest.raises(InvalidRequest) as e:
        await core.add_request("bad", [10**9], GREEDY)
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequest):
        await core.add_request("bad-2", PROMPTS[1], SamplingParams(max_tokens=0))
    assert len(await good) == GREEDY.max_tokens
    core.check_health()


async def test_a_prompt_larger_than_the_socket_buffer_crosses_and_is_refused_by_name(core):
    """~2 MB pickled: the writer thread carries it while the child steps another request."""
    good = asyncio.create_task(_tokens(core, "beside-huge", PROMPTS[1]))
    with pytest.raises(InvalidRequest) as e:
        await core.add_request("huge", [100 + i % 1000 for i in range(400_000)], GREEDY)
    assert e.value.field == "prompt"
    assert len(await good) == GREEDY.max_tokens


async def test_a_consumer_that_leaves_aborts_the_request_and_frees_its_blocks(core):
    stream = await core.add_request("left", PROMPTS[2], SamplingParams(max_tokens=400, temperature=0,
                                                                      ignore_eos=True))
    async for _ in stream:
        break
    await stream.aclose()
    await _wait_for(lambda: core.stats.num_requests == 0 and core.stats.kv_blocks_free == core.stats.kv_blocks_total)


async def test_a_caller_cancelled_while_its_request_starts_leaves_the_engine_healthy(core):
    """The reply to a cancelled call finds its future cancelled: the reader thread must
    carry on, and the request that did start is aborted."""
    busy = asyncio.create_task(_tokens(core, "busy", PROMPTS[0]))  # the child is mid-step
    await _wait_for(lambda: core.stats.num_running == 1)
    adding = asyncio.create_task(core.add_request("cancelled", PROMPTS[1], SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True)))
    await asyncio.sleep(0)  # the command is on its way
    adding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await adding
    assert len(await busy) == GREEDY.max_tokens
    assert len(await _tokens(core, "after-cancel", PROMPTS[2])) == GREEDY.max_tokens
    core.check_health()
    await _wait_for(lambda: core.stats.num_requests == 0 and core.stats.kv_blocks_free == core.stats.kv_blocks_total)


async def test_a_structured_request_compiles_its_grammar_in_the_child(core):
    sampling = SamplingParams(max_tokens=20, temperature=0,
                              structured=StructuredOutput("choice", json.dumps(["yes", "no"])))
    stream = await core.add_request("choice", PROMPTS[3], sampling)
    assert "".join([o.text async for outs in stream for o in outs]) in ("yes", "no")


async def test_a_request_cancelled_while_its_grammar_compiles_never_starts():
    """A fresh child's first grammar takes ~1 s (the tokenizer's index): the abort
    arrives first. The grammar pool is one FIFO thread, so once a second structured
    request has finished, the first one's grammar was long ready: had it started, its
    400 tokens would still be running."""
    client = EngineCoreClient(CFG, "aggregated", threads=1)
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    try:
        endless = StructuredOutput("regex", "[a-z ]+")
        adding = asyncio.create_task(client.add_request("first", PROMPTS[0], SamplingParams(
            max_tokens=400, temperature=0, ignore_eos=True, structured=endless)))
        await asyncio.sleep(0)
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding
        text = await _tokens(client, "second", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0,
                                                                         structured=choice))
        assert text
        assert "first" not in client.stats.request_ids and client.stats.num_requests == 0
        client.check_health()
    finally:
        client.shutdown()


async def test_a_child_that_dies_fails_the_health_check_and_every_stream():
    client = EngineCoreClient(CFG, "aggregated", threads=1)
    try:
        stream = await client.add_request("doomed", PROMPTS[0], SamplingParams(max_tokens=400, temperature=0,
                                                                              ignore_eos=True))
        os.kill(client.info.pid, signal.SIGKILL)
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass
        with pytest.raises(EngineDead):
            client.check_health()
        with pytest.raises(EngineDead):
            await client.add_request("after", PROMPTS[1], GREEDY)
    finally:
        client.shutdown()


def test_the_child_exits_when_its_replica_is_killed():
    """A replica killed outright (OOM, SIGKILL) leaves no engine holding a core."""
    script = textwrap.dedent(f"""
        import sys, time
        from engine.config import EngineConfig
        from engine.core_client import EngineCoreClient
        c = EngineCoreClient(EngineConfig.model_validate({CFG.model_dump()!r}), "aggregated", 1)
        print(c.info.pid, flush=True)
        time.sleep(600)
    """)
    # posix_spawn (no cwd, no fds to close): Popen's fork path waits for the new
    # process on a pipe that any other process forked from this test worker meanwhile
    # also holds open, and once waited here for the whole test timeout.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, close_fds=False,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        child = int(_read_line(parent.stdout, deadline=time.monotonic() + 120))
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, "the engine core outlived its replica"
            time.sleep(0.05)
    finally:
        parent.kill()


def _read_line(stream, deadline: float) -> str:
    while not select.select([stream], [], [], 0.5)[0]:
        assert time.monotonic() < deadline, "the replica stand-in never reported its engine core"
    return stream.readline()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
