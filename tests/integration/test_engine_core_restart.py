"""A replica whose engine core child dies starts a new one in place
(engine/core_restarts.py), here on real prefill and decode servers outside Ray, their
KV handed off over NIXL:

- the prefill child dies with a finished prefill's lease still out: the decode
  replica still pulls that KV (it is mapped in the replica, and the old backend serves
  it until the lease ends) and generates exactly what it would have; the replica
  reports `serving: false` to the routers until a new child is up, its KV events say
  every block is gone, and then it prefills again;
- the decode child dies mid-stream: the stream fails at once with EngineDead (the
  pipeline migrates it), the replica says it is lost, a new child comes up and the
  same request, handed off again, decodes to the same tokens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from decode.server import DecodeServer
from engine.config import EngineConfig
from engine.request import EngineDead
from engine.sampling_params import SamplingParams
from kvtransfer.messages import DecodeRequest, PrefillRequest, PrefillResult
from prefill.server import PrefillServer

pytestmark = pytest.mark.integration

ENGINE = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64).model_dump()
TRANSFER = {"backend": "nixl", "lease_ttl_s": 30.0}
PROMPT = tuple(range(200, 260))
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def _until(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not before the deadline"
        await asyncio.sleep(0.05)


def _kill(server) -> None:
    os.kill(server.aengine.proc.pid, signal.SIGKILL)


async def _prefill(prefill: PrefillServer, rid: str) -> PrefillResult:
    result = await prefill.prefill(PrefillRequest(rid, PROMPT, GREEDY))
    assert result.kv_handle is not None
    return result


async def _decode(decode: DecodeServer, result: PrefillResult, on_batch=None) -> list[int]:
    req = DecodeRequest(result.request_id, PROMPT, result.first_token, GREEDY, result.kv_handle)
    tokens = [result.first_token]
    async for outs in decode.generate(req):
        for out in outs:
            tokens.extend(out.new_token_ids)
        if on_batch is not None:
            on_batch(len(tokens))
    return tokens


@pytest.fixture(scope="module")
def servers():
    prefill = PrefillServer(ENGINE, 1, TRANSFER, {}, {})
    decode = DecodeServer(ENGINE, 1, TRANSFER)
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def test_a_lost_prefill_engine_is_replaced_and_its_lease_still_served(servers):
    prefill, decode = servers

    async def run() -> None:
        reference = await _decode(decode, await _prefill(prefill, "ref"))
        await _until(lambda: prefill.exporter.stats()["leases_active"] == 0, "the reference lease released")
        result = await _prefill(prefill, "a")  # leased, not yet pulled
        old_pid = prefill.aengine.proc.pid
        _kill(prefill)
        await _until(lambda: not prefill.restarts.serving, "the loss seen")
        assert prefill.record_routing_stats()["serving"] is False
        await prefill.check_health()  # a restart under way is not a failed health check
        # The dead engine's KV is still mapped here and served until its lease ends.
        assert await _decode(decode, result) == reference
        await _until(lambda: prefill.restarts.serving, "a new engine core")
        assert prefill.aengine.proc.pid != old_pid
        assert prefill.restarts.stats()["engine_restarts"] == 1
        assert prefill.record_routing_stats()["serving"] is True
        assert (await prefill.stats())["kv_events_cached_blocks"] == 0  # the new pool is empty
        again = await _prefill(prefill, "b")
        assert again.num_cached_tokens == 0
        assert await _decode(decode, again) == reference
        await _until(lambda: prefill.exporter.stats()["leases_active"] == 0, "every lease ended")

    asyncio.run(run())


def test_a_lost_decode_engine_fails_its_streams_and_is_replaced(servers):
    prefill, decode = servers

    async def run() -> None:
        reference = await _decode(decode, await _prefill(prefill, "ref2"))
        killed: list[int] = []

        def kill_at_fourth(n: int) -> None:
            if n >= 4 and not killed:
                killed.append(decode.aengine.proc.pid)
                _kill(decode)

        with pytest.raises(EngineDead):
            await _decode(decode, await _prefill(prefill, "c"), kill_at_fourth)
        assert killed
        assert decode.lost_replica() == decode.replica_id or decode.restarts.serving
        await _until(lambda: decode.restarts.serving and decode.lost_replica() is None, "a new engine core")
        await decode.check_health()
        assert decode.aengine.proc.pid != killed[0]
        assert decode.restarts.stats()["engine_restarts"] == 1
        assert await _decode(decode, await _prefill(prefill, "c")) == reference
        stats = await decode.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        await _until(lambda: prefill.exporter.stats()["leases_active"] == 0, "every lease ended")

    asyncio.run(run())
