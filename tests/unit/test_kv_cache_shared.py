"""A KV tensor in shared memory (engine/kv_cache.py `shared=True`) has every page
written at allocation, as a private `torch.zeros` tensor has: no step pays a
first-write fault on a block it has never used."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache

pytestmark = pytest.mark.unit

MODEL = ModelConfig(model_id="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                    num_kv_heads=2, head_dim=16, vocab_size=32, rope_theta=10000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
                    eos_token_ids=(0,))


def resident_kib(address: int) -> int:
    """Resident KiB of this process's mapping that holds `address` (and no other)."""
    inside = False
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and all(c in "0123456789abcdef-" for c in first):
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_shared_kv_tensor_is_resident_and_zero_from_the_start():
    kv = KVCache(MODEL, num_blocks=256, block_size=16, dtype=torch.float32, device="cpu",
                 shared=True)
    nbytes = kv.data.numel() * kv.data.element_size()  # 4 MiB: 1,024 pages
    assert resident_kib(kv.data.data_ptr()) * 1024 >= nbytes
    assert not kv.data.any()
