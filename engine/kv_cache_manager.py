"""Per-request block tables on top of the block pool: prefix matching, slot
allocation, caching of newly full blocks, and detaching blocks for a handoff."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.external_kv import ExternalKVCache, check_chunk_size
from engine.hashing import BlockHash, chain_root, hash_block
from engine.request import Request

log = logging.getLogger(__name__)


@dataclass
class ExternalKVStats:
    """What the external cache (engine/external_kv.py) gave and took."""

    lookups: int = 0
    hit_tokens: int = 0  # tokens found beyond the block pool's own hit
    loaded_tokens: int = 0  # of those, tokens really written into blocks
    load_failures: int = 0  # loads that wrote fewer tokens than the lookup promised
    stores: int = 0
    errors: int = 0  # calls that raised; the engine computed instead


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Where a waiting request's KV comes from: pool blocks, then [external_start,
    external_end) from the external cache, then computed."""

    blocks: list[int]
    external_start: int = 0
    external_end: int = 0
    pool_tokens: int = 0  # the pool's own hit, before any cut-back

    @property
    def num_external_tokens(self) -> int:
        return self.external_end - self.external_start


class KVCacheManager:
    """Owns the mapping request → block ids; the pool owns the blocks themselves."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        model_fingerprint: str,
        external: ExternalKVCache | None = None,
    ):
        self.pool = pool
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.external = external
        self.external_stats = ExternalKVStats()
        if external is not None:
            check_chunk_size(external.chunk_size, block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request) -> None:
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else chain_root(req.cache_salt)
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], self.model_fingerprint))

    def hittable_hashes(self, req: Request) -> list[BlockHash]:
        """The hashes of the request's leading full blocks that a prefix hit may cover
        (all but the block holding its last token, whose logits are needed)."""
        self._update_hashes(req)
        return req.block_hashes[: (req.num_tokens - 1) // self.block_size]

    def computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks for the request's leading tokens. At least one token is always
        left to compute, since the next token needs its logits."""
        hit = self.pool.cached_prefix(self.hittable_hashes(req))
        self.pool.record_query(req.num_tokens, len(hit) * self.block_size)
        return hit

    def match_prefix(self, req: Request) -> PrefixMatch:
        """Own block pool first, then the external cache for a longer prefix.

        An external hit is chunk-aligned, so when it wins, the pool hit is cut back
        to a chunk boundary and the external cache loads from there: blocks shared
        with other requests are never written.
        """
        blocks = self.computed_blocks(req)
        ext = self.external
        if ext is None:
            return PrefixMatch(blocks)
        pool_tokens = len(blocks) * self.block_size
        self.external_stats.lookups += 1
        try:
            found = ext.lookup(req.token_ids[: req.num_tokens - 1], req.cache_salt)
        except Exception:  # the tier is an optimisation; never fail a request on it
            log.exception("external KV lookup failed")
            self.external_stats.errors += 1
            return PrefixMatch(blocks)
        if found <= pool_tokens:
            return PrefixMatch(blocks)
        start = pool_tokens - pool_tokens % ext.chunk_size
        return PrefixMatch(blocks[: start // self.block_size], start, found, pool_tokens)

    def load_external(self, req: Request, match: PrefixMatch) -> None:
        """Fill [external_start, external_end) of the request's fresh blocks; progress
        stops where the load stopped, and the scheduler computes the rest."""
        assert self.external is not None  # a match with an external part came from it
        try:
            end = self.external.load(req.token_ids, req.block_ids, match.external_start, match.external_end,
                                     req.cache_salt)
        except Exception:
            log.exception("external KV load failed")
            self.external_stats.errors += 1
            end = match.external_start
        end = max(match.external_start, min(end, match.external_end))
        self.external_stats.loaded_tokens += end - match.external_start
        self.external_stats.hit_tokens += max(0, end - match.pool_tokens)
        if end < match.external_end:
            self.external_stats.load_failures += 1
        req.num_computed_tokens = end
        # An external cache may say where the tokens of its last load came from
        # (prefill/kv_tier: LMCache's cpu / disk / redis); else they count as "external".
        # Nothing loaded (the load failed or raised): whatever it says is an earlier load's.
        loaded = end - match.external_start
        sources = (getattr(self.external, "last_load_sources", None) or {"external": loaded}) if loaded else {}
        for source, n in sources.items():
            if n > 0:
                req.cached_tokens_by_source[source] = req.cached_tokens_by_source.get(source, 0) + n

    def store_external(self, req: Request) -> None:
        """The prompt's KV is complete: offer its full chunks to the external cache."""
        if self.external is None:
            return
        self.external_stats.stores += 1
        try:
            self.external.store(req.token_ids, req.block_ids, req.num_prompt_tokens, req.cache_salt)
        except Exception:
            log.exception("external KV store failed")
            self.external_stats.errors += 1

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

    def fork(self, child: Request, parent: Request) -> tuple[int, int] | None:
        """Give `child` the KV of the prompt it shares with `parent`, which has computed
        it; returns the (source, destination) block copy the engine must make before the
        next forward, or None (and no change) when the pool has no free block.

        Every block before the one holding the prompt's last token is shared (one more
        reference each). That block is copied (copy-on-write): the child computes its
        last prompt token again, into its own copy, for the logits of its own first
        token, and `parent` goes on writing its tokens into the original."""
        last = (child.num_prompt_tokens - 1) // self.block_size
        if self.pool.num_free_blocks < 1:
            return None
        shared = parent.block_ids[:last]
        self.pool.touch(shared)
        (copy,) = self.pool.allocate(1)
        child.block_ids = [*shared, copy]
        child.num_computed_tokens = child.num_prompt_tokens - 1
        child.num_hashed_blocks_cached = last  # the parent registered them, or another block holds their hash
        return parent.block_ids[last], copy

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
