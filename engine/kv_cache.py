"""The paged KV cache tensor of one replica.

Layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
(block-major): one block is one contiguous region of `bytes_per_block`, which is
what the transfer backends and the LMCache connector move. Attention reads it
through per-layer strided views and never copies the pool.
"""

from __future__ import annotations

import torch

from engine.config import ConfigError, EngineConfig, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem


def num_blocks_for(cfg: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_bytes is not None:
        n = cfg.kv_cache_bytes // bytes_per_block(model, cfg.block_size, dtype)
        if n < 2:
            raise ConfigError("kv_cache_bytes", f"{cfg.kv_cache_bytes} bytes hold fewer than 2 blocks")
        return int(n)
    # Enough for max_num_seqs sequences of max_model_len, capped at 2048 blocks (32K
    # tokens; 1.5 GB for SmolLM2 in fp32) so the default fits a laptop.
    per_seq = -(-cfg.max_model_len // cfg.block_size)
    return max(2, min(cfg.max_num_seqs * per_seq, 2048))


class KVCache:
    """Owns the KV tensor; hands out per-layer (K, V) views for attention."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim, dtype=dtype, device=device
        )
        self.layers = [(self.data[:, i, 0], self.data[:, i, 1]) for i in range(model.num_layers)]
        self.bytes_per_block = self.data[0].numel() * self.data.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's KV, every layer: a forked sequence's
        own copy of the block it will write into (copy-on-write)."""
        for src, dst in copies:
            self.data[dst].copy_(self.data[src])
