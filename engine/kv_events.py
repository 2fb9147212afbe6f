"""KV events: what the block pool tells the router about its prefix cache.

Emitted by `BlockPool` where blocks change (ARCHITECTURE.md: the router never
guesses). A block is *stored* when it becomes a full, hashed, reusable block and
*removed* when its hash leaves the pool (eviction or reset).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    num_tokens: int  # tokens covered by these blocks (len * block_size)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The pool was reset; every hash it held is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
