import pickle

import pytest

from kvtransfer.backends.base import PeerInfo, TransferMetrics, TransferStats
from kvtransfer.layout import LayoutFingerprint
from kvtransfer.messages import (
    DecodeRequest,
    KVHandle,
    PrefillResult,
    Reject,
    RejectReason,
    Release,
)

pytestmark = pytest.mark.unit

FP = LayoutFingerprint("m", "bfloat16", 16, 30, 3, 64)


def handle(num_tokens=40, block_ids=(9, 2, 5), expiry=2000.0):
    return KVHandle(
        request_id="r1",
        prefill_replica_id="prefill-0",
        backend="nixl",
        peer=PeerInfo("agent-1", FP, 128),
        block_ids=block_ids,
        num_tokens=num_tokens,
        fingerprint=FP,
        lease_id="lease-1",
        lease_expiry=expiry,
    )


def test_every_message_pickles():
    h = handle()
    msgs = [
        h,
        PrefillResult("r1", 42, h, num_cached_tokens=16, num_prompt_tokens=40, first_token_logprobs=-0.1),
        DecodeRequest("r1", list(range(40)), 42, {"temperature": 0.0}, h),
        Release("r1", "lease-1"),
        Reject("r1", "lease-1", RejectReason.NO_FREE_BLOCKS),
    ]
    for msg in msgs:
        assert pickle.loads(pickle.dumps(msg)) == msg


def test_handle_size_and_expiry():
    h = handle()
    assert h.num_blocks == 3
    assert h.num_bytes == 3 * FP.bytes_per_block
    assert not h.expired(now=1999.0)
    assert h.expired(now=2000.0)


def test_handle_block_count_must_cover_the_tokens():
    with pytest.raises(ValueError, match="needs 3 blocks"):
        handle(num_tokens=40, block_ids=(1, 2))


def test_decode_request_must_match_the_handle():
    with pytest.raises(ValueError, match="prompt has 39"):
        DecodeRequest("r1", list(range(39)), 42, None, handle())


def test_transfer_metrics_accumulate():
    m = TransferMetrics()
    m.record(TransferStats("nixl", 2, 200, 0.5))
    m.record(TransferStats("nixl", 1, 100, 0.25))
    m.record_failure()
    snap = m.snapshot()
    assert (snap.transfers, snap.failures, snap.bytes, snap.blocks, snap.seconds) == (2, 1, 300, 3, 0.75)
