"""Block pool with prefix caching.

NOTE on ownership and lifetime (the invariants live here):
- A block is *in use* while its ref count is > 0. Requests, and prefill handoff
  leases, each hold one reference; a block shared by two requests through a prefix
  hit has two.
- A block whose ref count drops to 0 goes to the tail of the free queue. If it
  carries a hash it stays in the prefix cache until it is reused: allocation takes
  from the head (least recently freed) and only then evicts the hash.
- A block's hash is set once, when the block is full and computed; it is removed
  only on eviction or reset. `BlockStored` / `BlockRemoved` are emitted exactly
  there, so the router's index mirrors this pool.
- A leased block (exported for a handoff) keeps its reference until the lease is
  released, rejected or expires (kvtransfer/lease.py); it is never overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.hashing import BlockHash
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class OutOfBlocks(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockPool:
    """Owns every block of one KV cache: ref counts, the free queue and the hash map."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        on_event: Callable[[KVEvent], None] | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._events: list[KVEvent] = []
        self._on_event = on_event
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cached_prefix(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest leading run of `hashes` held in the cache."""
        hit: list[int] = []
        if not self.enable_caching:
            return hit
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # ------------------------------------------------------------ ref counting
    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on already-computed blocks (a prefix hit or a lease)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block. Pass them tail-first so a request's last
        blocks are evicted before its shared prefix."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    # ------------------------------------------------------------ prefix cache
    def cache_blocks(self, block_ids: list[int], hashes: list[BlockHash], parent: BlockHash | None) -> None:
        """Register full, computed blocks under their hashes (first writer wins)."""
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        for block_id, h in zip(block_ids, hashes):
            block = self.blocks[block_id]
            if block.block_hash is not None or h in self._cached:
                continue
            block.block_hash = h
            self._cached[h] = block_id
            stored.append(h)
        if stored:
            self._emit(BlockStored(tuple(stored), parent, len(stored) * self.block_size))

    def record_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.stats.queried_tokens += queried_tokens
        self.stats.hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_cnt for b in self.blocks):
            return False
        for b in self.blocks:
            b.block_hash = None
        self._cached.clear()
        self._emit(AllBlocksCleared())
        return True

    def _evict(self, block: Block) -> None:
        h = block.block_hash
        block.block_hash = None
        if h is not None and self._cached.get(h) == block.block_id:
            del self._cached[h]
            self.stats.evictions += 1
            self._emit(BlockRemoved((h,)))

    # ------------------------------------------------------------ events
    def _emit(self, event: KVEvent) -> None:
        self._events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
