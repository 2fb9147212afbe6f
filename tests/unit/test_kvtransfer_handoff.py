"""export_kv / pull_kv over an in-process backend: the checks before any byte moves."""

import pytest
import torch

from kvtransfer.backends.base import KVTransferBackend, PeerDisconnected, PeerInfo, TransferStats
from kvtransfer.handoff import BackendMismatch, LeaseExpired, PeerMismatch, export_kv, pull_kv
from kvtransfer.layout import LayoutMismatch
from kvtransfer.lease import LeaseTable

pytestmark = pytest.mark.unit

_REGISTRY: dict[str, torch.Tensor] = {}


class InProcessBackend(KVTransferBackend):
    """Copies between tensors of one process; ``fail`` makes the next pull fail."""

    name = "inproc"

    def __init__(self, replica_id, model_id):
        super().__init__(replica_id, model_id)
        self.fail = False
        self.reads_expected: list[float] = []
        self.expecting = False  # between an expect_reads and a reads_ended

    def expect_reads(self, for_s):
        self.reads_expected.append(for_s)
        self.expecting = True

    def reads_ended(self):
        self.expecting = False

    def _register(self, kv):
        _REGISTRY[self.replica_id] = kv

    def peer_info(self):
        return PeerInfo(self.replica_id, self.fingerprint, self.kv.shape[0])

    def _pull(self, peer, remote, local, timeout_s):
        if self.fail:
            raise PeerDisconnected("gone")
        self.kv[local] = _REGISTRY[peer.peer_id][remote]
        return TransferStats(self.name, len(remote), len(remote) * self.fingerprint.bytes_per_block, 0.001)

    def close(self):
        pass


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def make(replica_id, dtype=torch.float32, model="m"):
    b = InProcessBackend(replica_id, model)
    kv = torch.randn(16, 2, 2, 4, 1, 8).to(dtype)
    b.register(kv)
    return b, kv


@pytest.fixture
def world():
    clock, freed = Clock(), []
    prefill, pkv = make("p")
    decode, dkv = make("d")
    leases = LeaseTable(freed.append, clock=clock)
    handle = export_kv(
        prefill, leases, request_id="r1", prefill_replica_id="p", block_ids=[7, 3, 11], num_tokens=10, ttl_s=30
    )
    return clock, freed, prefill, pkv, decode, dkv, leases, handle


def test_export_then_pull_copies_and_release_frees(world):
    clock, freed, prefill, pkv, decode, dkv, leases, handle = world
    assert handle.lease_expiry == clock.now + 30 and handle.backend == "inproc"
    assert prefill.reads_expected == [30]  # told, before the handle leaves, for the lease's TTL
    stats = pull_kv(decode, handle, [0, 1, 2], clock=clock)
    assert torch.equal(dkv[[0, 1, 2]], pkv[[7, 3, 11]])
    assert stats.bytes == 3 * decode.fingerprint.bytes_per_block
    assert freed == []
    assert leases.release(handle.lease_id)
    assert freed == [(7, 3, 11)]


def test_expired_lease_is_refused_before_pulling(world):
    clock, _, _, _, decode, dkv, _, handle = world
    before = dkv.clone()
    clock.now += 29.5  # inside the safety margin
    with pytest.raises(LeaseExpired):
        pull_kv(decode, handle, [0, 1, 2], clock=clock)
    assert torch.equal(dkv, before)


def test_a_peer_that_is_not_the_lease_owner_is_refused(world):
    """A handle naming one replica and carrying another's transfer peer (or a peer
    whose layout differs from the handle's) is never pulled."""
    import dataclasses

    *_, decode, dkv, _, handle = world
    before = dkv.clone()
    with pytest.raises(PeerMismatch):
        pull_kv(decode, dataclasses.replace(handle, prefill_replica_id="prefill#other"), [0, 1, 2], clock=Clock())
    other_layout = dataclasses.replace(handle.peer.fingerprint, dtype="bfloat16")
    forged = dataclasses.replace(handle, peer=dataclasses.replace(handle.peer, fingerprint=other_layout))
    with pytest.raises(LayoutMismatch):
        pull_kv(decode, forged, [0, 1, 2], clock=Clock())
    assert torch.equal(dkv, before)


def test_layout_and_backend_mismatch_are_refused(world):
    *_, handle = world
    other, _ = make("d2", dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatch, match="dtype"):
        pull_kv(other, handle, [0, 1, 2], clock=Clock())

    class OtherBackend(InProcessBackend):
        name = "other"

    ob = OtherBackend("d3", "m")
    ob.register(torch.zeros(16, 2, 2, 4, 1, 8))
    with pytest.raises(BackendMismatch):
        pull_kv(ob, handle, [0, 1, 2], clock=Clock())


def test_failed_pull_counts_a_failure(world):
    clock, _, _, _, decode, _, _, handle = world
    decode.fail = True
    with pytest.raises(PeerDisconnected):
        pull_kv(decode, handle, [0, 1, 2], clock=clock)
    assert decode.metrics.snapshot().failures == 1
