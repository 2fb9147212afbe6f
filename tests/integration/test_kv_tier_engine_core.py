"""A prefill engine core in its own process with an LMCache tier, built in the child
from the replica's `ExternalKVSpec` (engine/core_process.py).

A prompt one child prefilled is found by the next child on the same disk path (a
replica restarted): the same first token, its prefix loaded from disk into the new
child's shared pages byte for byte, and the tier's counters arriving with the step
messages. Each child closes its tier as it stops and exits cleanly.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache", reason="LMCache not installed (see scripts/setup.sh)")

from engine.config import EngineConfig  # noqa: E402
from engine.core_client import EngineCoreClient  # noqa: E402
from engine.engine import ExportedKV  # noqa: E402
from engine.request import RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from prefill.kv_tier.config import KVTierConfig  # noqa: E402

pytestmark = pytest.mark.integration

CFG = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=64)
CHUNK = 32  # two blocks
PROMPT = list(range(100, 100 + 3 * CHUNK + 5))  # three whole chunks and a few tokens
CHUNK_BLOCKS = 3 * CHUNK // CFG.block_size
GREEDY = SamplingParams(max_tokens=8, temperature=0)  # more than one: the prompt is exported for decode


def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not before the deadline"
        time.sleep(0.05)


async def _prefill(core: EngineCoreClient, request_id: str) -> RequestOutput:
    stream = await core.add_request(request_id, PROMPT, GREEDY)
    outs = [o async for batch in stream for o in batch]
    assert outs[-1].finished
    return outs[-1]


def test_a_prefill_child_stores_to_its_tier_and_the_next_child_loads_from_it(tmp_path: Path):
    disk = tmp_path / "kv"
    spec = KVTierConfig(disk_path=str(disk), disk_bytes=64 << 20, chunk_size=CHUNK).external_kv_spec()
    exports: list[ExportedKV] = []

    first = EngineCoreClient(CFG, "prefill", threads=1, on_export=exports.append, external_kv=spec)
    try:
        assert first.external_kv_stats["kv_tier_stored_tokens"] == 0  # the counters came with "ready"
        out = asyncio.run(_prefill(first, "a"))
        assert out.num_cached_tokens == 0
        _wait_for(lambda: first.external_kv_stats["kv_tier_stored_tokens"] == 3 * CHUNK, "the store counted")
        # LMCache writes disk chunks in the background: one file per chunk.
        _wait_for(lambda: disk.is_dir() and sum(1 for f in disk.iterdir() if f.is_file()) >= 3, "chunks on disk")
        (export,) = exports
        computed = first.kv_data[export.block_ids[:CHUNK_BLOCKS]].clone()
        first.release_blocks(export.block_ids).result(30)
    finally:
        first.shutdown()
    assert first.proc.returncode == 0  # the tier closed inside the stop timeout

    exports.clear()
    second = EngineCoreClient(CFG, "prefill", threads=1, on_export=exports.append, external_kv=spec)
    try:
        again = asyncio.run(_prefill(second, "b"))
        assert again.num_cached_tokens == 3 * CHUNK
        assert again.new_token_ids == out.new_token_ids
        assert second.external_kv_stats["kv_tier_disk_hit_tokens"] == 3 * CHUNK
        (export,) = exports
        assert torch.equal(second.kv_data[export.block_ids[:CHUNK_BLOCKS]], computed)
        second.release_blocks(export.block_ids).result(30)
    finally:
        second.shutdown()
    assert second.proc.returncode == 0


def test_a_tier_that_cannot_be_built_fails_the_child_at_start(tmp_path: Path):
    # A chunk of 24 tokens does not hold whole 16-token blocks: the child's engine
    # refuses the tier, and the replica's start fails with the reason.
    spec = KVTierConfig(cpu_bytes=1 << 20, chunk_size=24).external_kv_spec()
    with pytest.raises(Exception, match="chunk_size 24"):
        EngineCoreClient(CFG, "prefill", threads=1, on_export=lambda export: None, external_kv=spec)
