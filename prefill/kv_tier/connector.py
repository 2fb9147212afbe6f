"""LMCache connector over duet's paged KV cache.

duet keeps one tensor per replica, ``kv[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]`` (block-major: one block is one contiguous region), on
CPU or CUDA. LMCache's memory objects hold a chunk as ``[2, num_layers,
num_tokens, num_kv_heads * head_dim]`` (KV_2LTD). This connector copies between
the two by the request's block table, passed as the ``block_table`` kwarg of
`LMCacheEngine.store` / `retrieve`.

LMCache 0.5.6 ships no CPU connector, and its `MockGPUConnector` copies nothing,
hence this class.
"""

from __future__ import annotations

import torch
from lmcache.v1.gpu_connector import GPUConnectorInterface


class PagedKVConnector(GPUConnectorInterface):
    """Copies LMCache chunks to and from one replica's block-major KV tensor."""

    def __init__(self, kv: torch.Tensor) -> None:
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ValueError(
                "kv must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                f"got {tuple(kv.shape)}"
            )
        self.kv = kv
        _, self.num_layers, _, self.block_size, self.num_kv_heads, self.head_dim = kv.shape
        self.kvcaches = None

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_dim])

    def _blocks(self, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
        """Block ids covering [start, end) when both ends sit on block boundaries."""
        bs = self.block_size
        if start % bs or end % bs:
            return None
        return block_table[start // bs : end // bs]

    def _slots(self, block_table: torch.Tensor, start: int, end: int):
        pos = torch.arange(start, end, device=block_table.device)
        return block_table[pos // self.block_size], pos % self.block_size

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        table = _table(kwargs, self.kv.device)
        dst = memory_obj.tensor
        blocks = self._blocks(table, start, end)
        if blocks is not None:
            # [n, L, 2, bs, H, D] -> [2, L, n*bs, H*D]
            src = self.kv.index_select(0, blocks).permute(2, 1, 0, 3, 4, 5)
        else:
            b, off = self._slots(table, start, end)
            src = self.kv[b, :, :, off].permute(2, 1, 0, 3, 4)  # [T, L, 2, H, D] -> [2, L, T, H, D]
        dst.copy_(src.reshape(dst.shape))

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        table = _table(kwargs, self.kv.device)
        n = end - start
        src = memory_obj.tensor.to(self.kv.device, non_blocking=True)
        src = src.reshape(2, self.num_layers, n, self.num_kv_heads, self.head_dim)
        blocks = self._blocks(table, start, end)
        if blocks is not None:
            nb = n // self.block_size
            src = src.reshape(2, self.num_layers, nb, self.block_size, self.num_kv_heads, self.head_dim)
            self.kv.index_copy_(0, blocks, src.permute(2, 1, 0, 3, 4, 5).to(self.kv.dtype))
        else:
            b, off = self._slots(table, start, end)
            self.kv[b, :, :, off] = src.permute(2, 1, 0, 3, 4).to(self.kv.dtype)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for obj, start, end in zip(memory_objs or [], starts or [], ends or []):
            self.to_gpu(obj, start, end, **kwargs)


def _table(kwargs: dict, device: torch.device) -> torch.Tensor:
    if "block_table" not in kwargs:
        raise ValueError("PagedKVConnector needs the request's block_table kwarg")
    return torch.as_tensor(kwargs["block_table"], dtype=torch.long, device=device)
