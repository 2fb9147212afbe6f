"""The decode side of a handoff (kvtransfer/handoff.py `KVImporter`): it waits for KV
blocks an import could fit in and refuses at once one that never could; it holds the
blocks it filled until exactly one owner takes or discards them; and every way an
import ends (pulled, failed, cancelled, forgotten) frees what it reserved."""

import asyncio

import pytest
import torch
from test_kvtransfer_handoff import make

from kvtransfer.handoff import KVImporter, export_kv, reserve_when_free
from kvtransfer.lease import LeaseTable
from kvtransfer.messages import ImportFailed

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
    assert 1 <= pool.calls < 100  # backs off: a few calls, never a spin (a slow machine makes fewer)
    assert asyncio.run(reserve_when_free(Pool(10**6).reserve, could_fit=True, wait_s=-1.0)) is None  # no time left


class EnginePool:
    """The decode engine's block pool as the importer sees it (`ImportBlocks`)."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.free = list(range(num_blocks))
        self.num_blocks = num_blocks

    async def reserve_blocks(self, num_tokens: int) -> list[int] | None:
        n = -(-num_tokens // 4)
        if n > len(self.free):
            return None
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def could_ever_hold(self, num_tokens: int) -> bool:
        return -(-num_tokens // 4) <= self.num_blocks

    def release_blocks(self, block_ids: list[int]) -> None:
        self.free.extend(block_ids)


@pytest.fixture
def handoff():
    """A prefill backend with a leased 10-token prompt (3 blocks of 4), and a decode
    importer over a pool of 16 blocks."""
    freed: list = []
    prefill, pkv = make("p")
    decode, dkv = make("d")
    leases = LeaseTable(freed.append)
    handle = export_kv(prefill, leases, request_id="r1", prefill_replica_id="p", block_ids=[7, 3, 11],
                       num_tokens=10, ttl_s=30)
    pool = EnginePool()
    importer = KVImporter(decode, pool, timeout_s=5.0, lease_ttl_s=30.0, recompute_on_failure=False)
    return importer, pool, handle, pkv, dkv, decode


def test_an_import_pulls_into_reserved_blocks_taken_once(handoff):
    importer, pool, handle, pkv, dkv, _ = handoff
    imported = asyncio.run(importer.import_kv(handle))
    assert importer.stats().import_blocks_held == 3
    blocks = imported.take()
    assert torch.equal(dkv[blocks], pkv[[7, 3, 11]])
    assert len(pool.free) == 13 and importer.stats().import_blocks_held == 0
    with pytest.raises(RuntimeError, match="taken or discarded already"):
        imported.take()
    assert imported.discard() == 0 and len(pool.free) == 13  # the taker owns them now
    assert importer.stats().imports == 1


def test_a_discarded_import_frees_its_blocks(handoff):
    importer, pool, handle, *_ = handoff
    imported = asyncio.run(importer.import_kv(handle))
    assert imported.discard() == 3 and len(pool.free) == 16
    with pytest.raises(RuntimeError):
        imported.take()


def test_a_failed_pull_frees_the_blocks_and_raises(handoff):
    importer, pool, handle, _, _, decode = handoff
    decode.fail = True
    with pytest.raises(ImportFailed) as err:
        asyncio.run(importer.import_kv(handle))
    assert err.value.reason == "transfer_failed"
    assert len(pool.free) == 16 and importer.stats().import_failures == 1


def test_a_failed_pull_recomputes_when_configured(handoff):
    _, pool, handle, _, _, decode = handoff
    importer = KVImporter(decode, pool, timeout_s=5.0, lease_ttl_s=30.0, recompute_on_failure=True)
    decode.fail = True
    imported = asyncio.run(importer.import_kv(handle))
    assert imported.recompute and imported.take() is None
    assert len(pool.free) == 16 and importer.stats().import_recomputes == 1


def test_a_full_pool_rejects_the_lease(handoff):
    importer, pool, handle, *_ = handoff
    pool.free = []
    pool.num_blocks = 2  # could never hold 3 blocks: refused at once, no waiting
    with pytest.raises(ImportFailed) as err:
        asyncio.run(importer.import_kv(handle))
    assert err.value.reason == "no_free_blocks" and importer.stats().import_rejects == 1


def test_a_caller_cancelled_mid_import_leaves_nothing_held(handoff):
    importer, pool, handle, *_ = handoff

    async def leave_early():
        caller = asyncio.ensure_future(importer.import_kv(handle))
        await asyncio.sleep(0)  # the import has started
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        while importer.num_waiting:  # the import runs to its end on its own
            await asyncio.sleep(0.001)

    asyncio.run(leave_early())
    assert len(pool.free) == 16 and importer.stats().import_blocks_held == 0


def test_the_sweep_frees_blocks_whose_owner_lost_track(handoff):
    importer, pool, handle, *_ = handoff
    imported = asyncio.run(importer.import_kv(handle))
    assert importer.sweep() == 0  # not stale yet
    imported.since -= importer.stale_after_s + 1
    assert importer.sweep() == 3 and len(pool.free) == 16
    assert importer.stats().import_blocks_reclaimed == 3
    with pytest.raises(RuntimeError):
        imported.take()
