"""Per-request block tables on top of the block pool: prefix matching, slot
allocation, caching of newly full blocks, and detaching blocks for a handoff."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.hashing import ROOT_HASH, hash_block
from engine.request import Request


class KVCacheManager:
    """Owns the mapping request → block ids; the pool owns the blocks themselves."""

    def __init__(self, pool: BlockPool, block_size: int, model_fingerprint: str):
        self.pool = pool
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request) -> None:
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], self.model_fingerprint))

    def computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks for the request's leading tokens. At least one token is always
        left to compute, since the next token needs its logits."""
        self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = self.pool.cached_prefix(req.block_hashes[:max_blocks])
        self.pool.record_query(req.num_tokens, len(hit) * self.block_size)
        return hit

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if the pool
        cannot. `computed` are prefix-hit blocks to adopt first."""
        if computed:
            self.pool.touch(computed)
            req.block_ids.extend(computed)
            req.num_computed_tokens = len(computed) * self.block_size
            req.num_hashed_blocks_cached = len(computed)
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need > self.pool.num_free_blocks:
            if computed:
                del req.block_ids[-len(computed) :]
                self.pool.free(reversed(computed))
                req.num_computed_tokens = 0
                req.num_hashed_blocks_cached = 0
            return False
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        self._update_hashes(req)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        start = req.num_hashed_blocks_cached
        if full > start:
            parent = req.block_hashes[start - 1] if start else None
            self.pool.cache_blocks(req.block_ids[start:full], req.block_hashes[start:full], parent)
            req.num_hashed_blocks_cached = full

    def free(self, req: Request) -> None:
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_hashed_blocks_cached = 0

    def detach(self, req: Request) -> list[int]:
        """Hand the request's blocks (and their references) to the caller: a prefill
        export keeps them pinned until the lease ends (`release_blocks`)."""
        ids, req.block_ids = req.block_ids, []
        return ids

    def release_blocks(self, block_ids: list[int]) -> None:
        self.pool.free(reversed(block_ids))
