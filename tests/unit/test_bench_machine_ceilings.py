"""The engine benchmark's rooflines (bench/machine_ceilings.py): the model's matmul
shapes and the ceiling each point gets from measured speeds (numbers made up here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.machine_ceilings import Ceilings, cpu_flags, matmul_shapes

pytestmark = pytest.mark.unit

SMOLLM2 = SimpleNamespace(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                          head_dim=64, vocab_size=49152)


def test_the_shapes_are_the_engines_fused_matmuls_and_the_lm_head():
    shapes = matmul_shapes(SMOLLM2)
    assert shapes == [(576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1)]
    # SmolLM2-135M: 134.5M weights in matmuls per token (the tied embedding counted once, as the LM head)
    assert sum(k * n * c for k, n, c in shapes) == 134_479_872


def _ceilings(read_gbps: float, gemm: dict[int, float]) -> Ceilings:
    return Ceilings(cpu_flags=[], threads=2, dtype="float32", read_gbps=read_gbps, gemm_gflops=gemm,
                    weight_bytes=500_000_000, flops_per_token=250e6)


def test_decode_is_bandwidth_bound_at_batch_1_and_compute_bound_when_large():
    c = _ceilings(read_gbps=25.0, gemm={8: 120.0, 32: 200.0})
    assert c.decode_tok_s(1) == pytest.approx(50.0)  # 25 GB/s over 0.5 GB of weights per step
    assert c.decode_tok_s(8) == pytest.approx(400.0)  # still the weights: 2 GFLOP at 120 GFLOP/s is 16.7 ms < 20
    # 32 tokens x 250 MFLOP at 200 GFLOP/s = 40 ms > 20 ms to read the weights
    assert c.decode_tok_s(32) == pytest.approx(800.0)
    assert c.prefill_tok_s(32) == pytest.approx(800.0)


def test_the_flags_are_a_subset_of_the_known_ones():
    assert set(cpu_flags()) <= {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                                "amx_int8"}
