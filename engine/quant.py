"""Weight-only int8: the linear weights stored as int8 with one scale per output
channel, multiplied by bf16 activations.

Batch-1 decode reads every weight once per token, so it is bound by memory
bandwidth: int8 weights read a quarter of fp32's bytes and half of bf16's. The
activations stay in bf16, and the product is PyTorch's own CPU kernel for
weight-only int8 (`aten._weight_int8pack_mm`), so no weight is dequantized in
memory.

The embedded checkpoint's weights are already 4-bit GGUF dequantized, so a
symmetric per-channel int8 copy (127 levels per sign) adds little error on top:
tests/unit/test_quant.py holds the engine to the fp32 path within a stated
tolerance.

The other form a linear weight takes here is `PackedWeight`: an fp32 weight
pre-packed for oneDNN, which decode batches use on the CPU (`engine.packed_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from engine.config import ConfigError

WeightQuant = Literal["none", "int8"]


def activation_dtype(quant: WeightQuant, dtype_name: str, dtype: torch.dtype, device: str) -> torch.dtype:
    """The engine's dtype given its weight quantization; a clear error where the
    combination has no fast kernel. PyTorch's int8 weight-only kernel is fast on the
    CPU with bf16 activations only (with fp32 ones it measured 2-14x slower than
    dense fp32, docs/benchmarks.md), so `auto` means bf16 with int8 weights."""
    if quant == "none":
        return dtype
    if device != "cpu":
        raise ConfigError("weight_quant", f"{quant!r} weights run on the CPU only, not {device}")
    if dtype_name == "auto":
        return torch.bfloat16
    if dtype != torch.bfloat16:
        raise ConfigError("weight_quant", f"{quant!r} weights need bfloat16 activations (dtype auto or bfloat16), "
                                          f"not {dtype_name}: PyTorch's int8 kernel has no fast path for them")
    return dtype


@dataclass(frozen=True)
class Int8Weight:
    """A `[in, out]` linear weight as int8 `[out, in]` plus fp scales `[out]`."""

    qweight: torch.Tensor  # int8 [out, in], contiguous (the kernel's layout)
    scales: torch.Tensor  # [out], in the activations' dtype

    @classmethod
    def quantize(cls, w_in_out: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
        w = w_in_out.t().float()  # [out, in]
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return cls(q, scales.to(dtype))

    def dequantize(self) -> torch.Tensor:
        """The `[in, out]` weight this stands for, in the scales' dtype."""
        return (self.qweight.float() * self.scales.float()[:, None]).t().to(self.scales.dtype)


@dataclass(frozen=True)
class PackedWeight:
    """An fp32 CPU weight pre-packed for oneDNN (its blocked layout), with the plain
    `[in, out]` copy kept only where some products run faster on it.

    With a few rows (a decode batch) and weights far larger than the caches, MKL's
    fp32 GEMM on the plain weight measured up to 2.7x slower than oneDNN's linear on a
    weight packed once, at load. On one thread, one-row products (decode at batch 1:
    a matrix-vector product, bound by reading the weight once) are faster on the plain
    copy, so it is kept and used for them and for long prefill chunks
    (`PACKED_MAX_ROWS`). On two threads or more the packed product was as fast or
    faster at every row count measured, so the plain copy is dropped, and with it the
    packing's memory cost (docs/benchmarks.md, packed weights)."""

    packed: torch.Tensor  # oneDNN's blocked layout of the [out, in] weight
    dense: torch.Tensor | None  # [in, out]; None: every product takes the packed copy

    @classmethod
    def pack(cls, w_in_out: torch.Tensor, keep_dense: bool = True) -> PackedWeight:
        return cls.pack_out_in(w_in_out.t(), keep_dense)  # a contiguous [in, out] is kept as it is

    @classmethod
    def pack_out_in(cls, w_out_in: torch.Tensor, keep_dense: bool = True) -> PackedWeight:
        """The same from the `[out, in]` weight a checkpoint stores: oneDNN packs that
        layout, so only the plain copy, where kept, costs a transpose (a model load does
        one copy per weight instead of two, or none on two threads)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(w_out_in.contiguous(), None)
        return cls(packed, w_out_in.t().contiguous() if keep_dense else None)

    def packed_product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w` for 2-D `x` through the packed copy, whatever its row count."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w` on whichever copy is faster for `x`'s row count."""
        if self.dense is not None and not 1 < x.numel() // x.shape[-1] <= PACKED_MAX_ROWS:
            return x @ self.dense
        lead = x.shape[:-1]
        out = self.packed_product(x.reshape(-1, x.shape[-1]))
        return out.reshape(*lead, out.shape[-1])


def keeps_dense_copy(threads: int) -> bool:
    """Whether packed weights keep their plain copy: on one thread only. The model's
    products per step, weights out of cache, ms, plain against packed: one thread, one
    row 36-44 against 45-50 (AVX-512), 43 against 52 (AVX2); two threads, one row 33
    against 28 (AVX-512), 32 against 29 (AVX2), 256 rows 577 against 364 (AVX-512),
    507 against 465 (AVX2)."""
    return threads < 2


Linear = torch.Tensor | Int8Weight | PackedWeight

# With the plain copy kept (one thread), the row counts whose products use the packed
# one. Measured on the model's own shapes, fp32, one thread, weights out of cache:
# one row 43 ms plain against 52 packed for all 30 layers and the head (AVX2); 8 rows
# 120 against 73; 32 rows 178 against 149; 256 rows 874 against 900 on AVX2, 915
# against 700 on AVX-512 (docs/benchmarks.md).
PACKED_MAX_ROWS = 128


def packs_weights(setting: str, device: str, dtype: torch.dtype, quant: WeightQuant) -> bool:
    """Whether an engine packs its dense weights for oneDNN: `auto` where it measured
    faster (fp32 on a CPU whose PyTorch has oneDNN); `on` there only, else an error."""
    supported = device == "cpu" and dtype == torch.float32 and quant == "none" and torch.backends.mkldnn.is_available()
    if setting == "on" and not supported:
        raise ConfigError("packed_weights", "packed weights need float32 dense weights on a CPU with oneDNN, "
                                            f"not {dtype} on {device} (weight_quant {quant})")
    return supported and setting != "off"


# Above this many rows (a prefill chunk) the int8 kernel loses to dequantizing into
# a dense GEMM. Measured in bf16: with 32 rows the kernel ran 225 tok/s against 143
# dequantizing each step's weights; for a 512-token prefill it ran 615 against
# 2,007 (that dequantize went through fp32; the bf16 one below is cheaper). The
# crossover lies between; 64 is a guess inside that range.
INT8_KERNEL_MAX_ROWS = 64


def matmul(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """`x @ w` for a dense `[in, out]` weight, its int8 form or its packed one."""
    if isinstance(w, Int8Weight):
        if x.numel() // x.shape[-1] > INT8_KERNEL_MAX_ROWS:  # weights as [out, in]: F.linear's layout
            return torch.nn.functional.linear(x, w.qweight.to(x.dtype) * w.scales[:, None])
        lead = x.shape[:-1]
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), w.qweight, w.scales)
        return out.reshape(*lead, out.shape[-1])
    if isinstance(w, PackedWeight):
        return w.product(x)
    return x @ w


def maybe_quantize(w_in_out: torch.Tensor, quant: WeightQuant, dtype: torch.dtype) -> Linear:
    return Int8Weight.quantize(w_in_out, dtype) if quant == "int8" else w_in_out
