"""This machine's ceilings for `duet bench engine`, measured in the same run.

The CPUs under these machines change from day to day (AVX-512 with bf16 one day,
AVX2 only the next, with half the GEMM speed), so a figure means little without the
speed the same machine gives in isolation. Two speeds are measured:

- memory read bandwidth: a reduction over a buffer far larger than the caches;
- GEMM speed on the model's own matmuls (`x @ w` with `w` stored `[in, out]`, as
  engine/model.py does: fused QKV, output, fused gate-up, down, and the LM head),
  with as many rows as the step has tokens; for fp32 on a CPU with oneDNN, the
  faster of that and oneDNN's product on the pre-packed weight (engine/quant.py
  `PackedWeight`), which beats MKL on a few rows: a ceiling the engine can pass
  bounds nothing.

A point's ceiling is then a roofline: one step cannot be faster than reading every
weight once (the weight bytes over the bandwidth) or than its matmul FLOPs at the
measured GEMM speed. At batch 1 only the bandwidth counts: a one-row GEMM's speed is
a library's matrix-vector kernel, not the machine's. Attention's own FLOPs and the
element-wise ops are left out: they are what the engine adds, so they count against
it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from engine import config as engine_config
from engine.quant import PackedWeight

# The flags that decide which kernels oneDNN/MKL can use for fp32 and bf16.
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
_READ_BYTES = 1 << 30


def cpu_flags() -> list[str]:
    """The FLAGS this CPU has (Linux; empty elsewhere)."""
    have = set(engine_config.cpu_flags())
    return [f for f in FLAGS if f in have]


def matmul_shapes(model) -> list[tuple[int, int, int]]:
    """`(in, out, count)` of every weight matmul one token goes through."""
    c = model.config if hasattr(model, "config") else model
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = [(c.hidden_size, q + 2 * kv), (q, c.hidden_size), (c.hidden_size, 2 * c.intermediate_size),
                 (c.intermediate_size, c.hidden_size)]
    return [(i, o, c.num_layers) for i, o in per_layer] + [(c.hidden_size, c.vocab_size, 1)]


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch pages, kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_gbps(repeats: int = 5) -> float:
    buf = torch.ones(_READ_BYTES // 4, dtype=torch.float32)
    seconds = _median_seconds(lambda: buf.sum(), repeats)
    return _READ_BYTES / seconds / 1e9


def _packable(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def gemm_gflops(shapes: list[tuple[int, int, int]], rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of one pass over every distinct shape, weighted by how often the model
    runs it (a shape's time × its count); per shape, the faster weight form."""
    flops = seconds = 0.0
    for k, n, count in shapes:
        x = torch.randn(rows, k).to(dtype)
        w = torch.randn(k, n).to(dtype)
        s = _median_seconds(lambda x=x, w=w: x @ w, repeats)
        if _packable(dtype):
            packed = PackedWeight.pack(w)
            s = min(s, _median_seconds(lambda x=x, p=packed: p.packed_product(x), repeats))
        flops += 2.0 * rows * k * n * count
        seconds += s * count
    return flops / seconds / 1e9


@dataclass(frozen=True)
class Ceilings:
    cpu_flags: list[str]
    threads: int
    dtype: str
    read_gbps: float
    # rows (tokens in one step) -> GFLOP/s on the model's shapes
    gemm_gflops: dict[int, float]
    weight_bytes: int
    flops_per_token: float

    def decode_tok_s(self, batch: int) -> float:
        """A decode step of `batch` sequences: bounded by reading the weights once
        and (batch > 1) by `batch` tokens' matmuls."""
        read_s = self.weight_bytes / (self.read_gbps * 1e9)
        if batch == 1:
            return 1 / read_s
        compute_s = batch * self.flops_per_token / (self.gemm_gflops[batch] * 1e9)
        return batch / max(read_s, compute_s)

    def prefill_tok_s(self, tokens: int) -> float:
        return self.gemm_gflops[tokens] * 1e9 / self.flops_per_token

    def as_dict(self) -> dict:
        return {**asdict(self), "gemm_gflops": {str(k): v for k, v in self.gemm_gflops.items()}}


def measure(model_config, dtype: torch.dtype, rows: list[int], weight_quant: str = "none") -> Ceilings:
    """`weight_quant="int8"`: the weights are read as one byte each (engine/quant.py);
    the GEMM ceiling stays the activations' dtype's, since int8 weights save no FLOPs."""
    shapes = matmul_shapes(model_config)
    elems = sum(k * n * count for k, n, count in shapes)
    element_size = 1 if weight_quant == "int8" else torch.empty((), dtype=dtype).element_size()
    return Ceilings(
        cpu_flags=cpu_flags(),
        threads=torch.get_num_threads(),
        dtype=str(dtype).removeprefix("torch."),
        read_gbps=read_gbps(),
        gemm_gflops={r: gemm_gflops(shapes, r, dtype) for r in sorted(set(rows) - {1})},
        weight_bytes=elems * element_size,
        flops_per_token=2.0 * elems,
    )
