"""The KV layout fingerprint: what two replicas must agree on to exchange blocks.

The engine fixes the layout: one contiguous tensor per replica of shape
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, so a block is
one contiguous byte range. Two replicas can copy blocks byte-for-byte only when
every field below matches; ``num_blocks`` may differ (pools are sized per replica).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class LayoutMismatch(ValueError):
    """Two replicas' KV layouts differ; the handoff must be rejected, not recomputed."""

    def __init__(self, field: str, local: object, remote: object) -> None:
        super().__init__(f"KV layout mismatch on {field!r}: local={local!r} remote={remote!r}")
        self.field = field
        self.local = local
        self.remote = remote


@dataclass(frozen=True)
class LayoutFingerprint:
    """Owns the identity of a KV block layout; travels with every ``KVHandle``."""

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPE_SIZES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def element_size(self) -> int:
        return _DTYPE_SIZES[self.dtype]

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        return self.block_numel * self.element_size

    @classmethod
    def from_tensor(cls, kv: torch.Tensor, model_id: str) -> LayoutFingerprint:
        """Read the fingerprint off an engine KV tensor, checking the contract."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ValueError(
                "KV tensor must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(kv.shape)}"
            )
        if not kv.is_contiguous():
            raise ValueError("KV tensor must be contiguous: blocks are copied as byte ranges")
        dtype = str(kv.dtype).removeprefix("torch.")
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv.shape
        return cls(model_id, dtype, block_size, num_layers, num_kv_heads, head_dim)

    def check_compatible(self, other: LayoutFingerprint) -> None:
        """Raise ``LayoutMismatch`` naming the first differing field."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise LayoutMismatch(f.name, mine, theirs)
