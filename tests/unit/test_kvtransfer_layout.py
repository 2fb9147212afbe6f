import pickle

import pytest
import torch

from kvtransfer.layout import LayoutFingerprint, LayoutMismatch

pytestmark = pytest.mark.unit


def kv(dtype=torch.float32, heads=3):
    return torch.zeros(8, 2, 2, 16, heads, 64, dtype=dtype)


def test_from_tensor_reads_the_engine_layout():
    fp = LayoutFingerprint.from_tensor(kv(torch.bfloat16), "smollm2")
    assert fp == LayoutFingerprint("smollm2", "bfloat16", 16, 2, 3, 64)
    assert fp.bytes_per_block == kv(torch.bfloat16)[0].numel() * 2


@pytest.mark.parametrize(
    "field, other",
    [
        ("model_id", LayoutFingerprint.from_tensor(kv(), "other-model")),
        ("dtype", LayoutFingerprint.from_tensor(kv(torch.bfloat16), "m")),
        ("num_kv_heads", LayoutFingerprint.from_tensor(kv(heads=4), "m")),
    ],
)
def test_mismatch_is_rejected_naming_the_field(field, other):
    mine = LayoutFingerprint.from_tensor(kv(), "m")
    with pytest.raises(LayoutMismatch, match=field) as err:
        mine.check_compatible(other)
    assert err.value.field == field


def test_compatible_layouts_pass_even_with_different_pool_sizes():
    a = LayoutFingerprint.from_tensor(torch.zeros(4, 2, 2, 16, 3, 64), "m")
    b = LayoutFingerprint.from_tensor(torch.zeros(99, 2, 2, 16, 3, 64), "m")
    a.check_compatible(b)


def test_non_contiguous_or_wrong_rank_tensor_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        LayoutFingerprint.from_tensor(kv().transpose(0, 1), "m")
    with pytest.raises(ValueError, match="shape"):
        LayoutFingerprint.from_tensor(torch.zeros(8, 2, 16, 3, 64), "m")


def test_fingerprint_pickles():
    fp = LayoutFingerprint.from_tensor(kv(), "m")
    assert pickle.loads(pickle.dumps(fp)) == fp
