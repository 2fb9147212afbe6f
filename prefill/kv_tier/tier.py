"""KV tier beyond one replica's block pool: LMCache over local CPU, local disk, Redis.

A prefill replica looks a prompt up here after its own block pool misses, loads
the cached prefix into freshly allocated blocks, and stores newly computed *full
chunks* afterwards. Chunks are `chunk_size` tokens (a multiple of the block size);
only whole chunks are stored and found, so a hit always ends on a block boundary.
`KVTier` is the engine's `ExternalKVCache` (engine/external_kv.py).

Ownership: the tier never frees or allocates blocks. The caller passes a block
table it owns for the duration of the call; `retrieve` writes into those blocks,
`store` only reads them.

Tenants: a request's cache salt becomes an LMCache key tag (`_salted`), so its chunks
are stored and found under its salt only, in every tier.

Failure policy: a Redis that does not answer is bypassed and probed again later
(prefill/kv_tier/health.py); CPU and disk keep working.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid

import torch

from engine.external_kv import check_chunk_size
from engine.hashing import salt_tag
from prefill.kv_tier.config import KVTierConfig
from prefill.kv_tier.connector import PagedKVConnector
from prefill.kv_tier.health import RedisHealth
from prefill.kv_tier.lmcache_compat import patch_redis_connector_close, recover_disk_index, stable_chunk_hash
from prefill.kv_tier.stats import CPU_BACKEND, DISK_BACKEND, REDIS_BACKEND, TIERS, KVTierStats

log = logging.getLogger(__name__)

SALT_TAG = "lmcache.tag.salt"  # LMCache puts `lmcache.tag.*` request configs in the key


class KVTier:
    """Owns one replica's LMCache engine and its view of the paged KV tensor."""

    def __init__(self, config: KVTierConfig, kv: torch.Tensor, model_fingerprint: str) -> None:
        if not config.enabled:
            raise ValueError("KVTier needs at least one tier on (cpu_bytes, disk_path or redis_url)")
        block_size = kv.shape[3]
        check_chunk_size(config.chunk_size, block_size)
        os.environ.setdefault("PYTHONHASHSEED", "0")
        # LMCache reports usage to its project's server by default, from a thread each
        # engine starts (which also runs py-cpuinfo in a subprocess): a serving cluster
        # sends nothing out unless its operator asks (LMCACHE_TRACK_USAGE=true), as
        # with Ray's usage stats.
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        patch_redis_connector_close()
        self.config = config
        self.kv = kv
        self.block_size = block_size
        self.stats = KVTierStats()
        # Tokens of the last `retrieve` by tier (read by the engine right after `load`).
        self.last_load_sources: dict[str, int] = {}
        self._lock = threading.Lock()
        self._instance_id = f"duet-{uuid.uuid4().hex[:12]}"
        _, num_layers, _, _, num_kv_heads, head_dim = kv.shape
        gib = 1024**3
        cfg = LMCacheEngineConfig.from_dict(
            {
                "chunk_size": config.chunk_size,
                # LMCache stages every chunk in CPU memory, so the CPU pool exists
                # even when the CPU tier is "off"; then it is only a staging area.
                "local_cpu": config.cpu_bytes > 0,
                "max_local_cpu_size": max(config.cpu_bytes, 64 * 1024**2) / gib,
                "local_disk": f"file://{config.disk_path}" if config.disk_path else None,
                "max_local_disk_size": config.disk_bytes / gib,
                "remote_url": config.redis_url,
                "remote_serde": "naive",
                "save_unfull_chunk": False,
                "lmcache_instance_id": self._instance_id,
            }
        )
        cfg.validate()
        metadata = LMCacheMetadata(
            # Keys and file names embed the model name; a digest keeps them free
            # of the '@' and '/' that LMCache uses as separators.
            model_name=f"{config.namespace}-" + hashlib.sha256(model_fingerprint.encode()).hexdigest()[:16],
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=kv.dtype,
            kv_shape=(num_layers, 2, config.chunk_size, num_kv_heads, head_dim),
            chunk_size=config.chunk_size,
        )
        self._engine = LMCacheEngineBuilder.get_or_create(
            self._instance_id, cfg, metadata, PagedKVConnector(kv), None, None
        )
        self._engine.post_init()  # creates the storage backends
        self._engine.token_database.hash_func = stable_chunk_hash
        self._backends = set(self._engine.storage_manager.storage_backends)
        if DISK_BACKEND in self._backends:
            recover_disk_index(self._engine, metadata, config.chunk_size, kv, DISK_BACKEND)
        self._redis: RedisHealth | None = None
        if config.redis_url is not None:
            self._redis = RedisHealth(
                config.redis_url, config.redis_timeout_s, config.redis_check_interval_s,
                config.redis_retry_interval_s, self.stats.redis, self._bypass_redis,
            )
            self._redis.check(force=True)
        self._closed = False

    def _tier_on(self, backend: str) -> bool:
        if backend not in self._backends:
            return False
        if backend == CPU_BACKEND:
            return self.config.cpu_bytes > 0  # otherwise only a staging area
        return backend != REDIS_BACKEND or self._redis is None or self._redis.up

    def _bypass_redis(self, up: bool) -> None:
        if REDIS_BACKEND in self._backends:
            self._engine.storage_manager.set_backend_bypass(REDIS_BACKEND, not up)

    def _check_redis(self) -> None:
        if self._redis is not None:
            self._redis.check()

    def _lookup_tiers(self, tokens: torch.Tensor, cache_salt: str | None) -> dict[str, int]:
        """Cached prefix length in each tier that is on."""
        return {
            name: self._engine.lookup(tokens, search_range=[backend], request_configs=_salted(cache_salt))
            for name, backend in TIERS
            if self._tier_on(backend)
        }

    def lookup(self, token_ids, cache_salt: str | None = None) -> int:
        """Tokens of `token_ids`' prefix available in any tier (a multiple of chunk_size)."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long)
        with self._lock:
            self._check_redis()
            t0 = time.perf_counter()
            per_tier = self._lookup_tiers(tokens, cache_salt)
            found = max(per_tier.values(), default=0)
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(tokens)
            self.stats.lookup_hit_tokens += found
            self.stats.lookup_s += time.perf_counter() - t0
            return found

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def retrieve(self, token_ids, block_table, num_tokens: int, start: int = 0, cache_salt: str | None = None) -> int:
        """Load the KV of tokens [start, num_tokens) into `block_table`'s blocks;
        the blocks of [0, start) are not written (they may be shared).

        `start` must be a multiple of chunk_size. Returns `t` such that the KV of
        [start, t) was loaded (t is a multiple of chunk_size, or `start`); the
        caller computes the rest.
        """
        if start % self.config.chunk_size:
            raise ValueError(f"start {start} is not a multiple of chunk_size {self.config.chunk_size}")
        if num_tokens <= start:
            return start
        tokens = torch.as_tensor(token_ids[:num_tokens], dtype=torch.long)
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:start] = False
        with self._lock:
            self._check_redis()
            per_tier = self._lookup_tiers(tokens, cache_salt)
            t0 = time.perf_counter()
            ret = self._engine.retrieve(tokens, mask=mask, block_table=_as_table(block_table),
                                        request_configs=_salted(cache_salt))
            elapsed = time.perf_counter() - t0
            loaded = start + _leading_true(ret[start:])
            self.stats.retrieves += 1
            self.stats.retrieved_tokens += loaded - start
            # Backends are read in order CPU, disk, Redis: attribute each token
            # to the first tier that holds it.
            covered = start
            bytes_per_token = self._bytes_per_token()
            self.last_load_sources = {}
            for name, _ in TIERS:
                upto = min(per_tier.get(name, 0), loaded)
                if upto > covered:
                    self.last_load_sources[name] = upto - covered
                    t = self.stats.tiers[name]
                    t.hit_tokens += upto - covered
                    t.hit_bytes += (upto - covered) * bytes_per_token
                    t.retrieve_s += elapsed * (upto - covered) / (loaded - start)
                    covered = upto
            return loaded

    # ExternalKVCache (engine/external_kv.py): the engine's view of this tier.
    def load(self, token_ids, block_ids, start: int, end: int, cache_salt: str | None = None) -> int:
        return self.retrieve(token_ids, block_ids, end, start, cache_salt)

    def as_dict(self) -> dict:
        """Flat counters for `stats()` and Prometheus (see `KVTierStats.as_dict`)."""
        out: dict[str, float | None] = {**self.stats.as_dict()}
        out["kv_tier_redis_up"] = int(self._redis.up) if self._redis is not None else None
        return out

    def store(self, token_ids, block_table, num_tokens: int, cache_salt: str | None = None) -> int:
        """Store the KV of the leading full chunks of `num_tokens` tokens.

        Returns the tokens handed to LMCache (already cached chunks included).
        """
        n = num_tokens - num_tokens % self.config.chunk_size
        if n <= 0:
            return 0
        tokens = torch.as_tensor(token_ids[:n], dtype=torch.long)
        with self._lock:
            self._check_redis()
            t0 = time.perf_counter()
            self._engine.store(tokens, block_table=_as_table(block_table), request_configs=_salted(cache_salt))
            self.stats.store_s += time.perf_counter() - t0
            self.stats.stores += 1
            self.stats.stored_tokens += n
            self.stats.stored_bytes += n * self._bytes_per_token()
            return n

    def _bytes_per_token(self) -> int:
        _, layers, _, _, heads, dim = self.kv.shape
        return layers * 2 * heads * dim * self.kv.element_size()

    def close(self) -> None:
        """Flush and release LMCache; never blocks longer than `close_timeout_s`."""
        if self._closed:
            return
        self._closed = True
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        t = threading.Thread(
            target=LMCacheEngineBuilder.destroy, args=(self._instance_id,), daemon=True
        )
        t.start()
        t.join(self.config.close_timeout_s)
        if t.is_alive():
            log.error("KV tier: LMCache close did not finish in %.1fs; left behind", self.config.close_timeout_s)
        if self._redis is not None:
            self._redis.close()

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_tier(config: dict, kv: torch.Tensor, model_fingerprint: str) -> KVTier:
    """`KVTierConfig.external_kv_spec`'s factory: the tier, built where the engine runs."""
    return KVTier(KVTierConfig.model_validate(config), kv, model_fingerprint)


def _salted(cache_salt: str | None) -> dict[str, str] | None:
    """LMCache's per-request configs for a salt: a key tag, so a salted chunk's key
    (and its disk file and Redis key names) differs from every other salt's."""
    return {SALT_TAG: salt_tag(cache_salt)} if cache_salt else None


def _as_table(block_table) -> torch.Tensor:
    return torch.as_tensor(block_table, dtype=torch.long)


def _leading_true(mask: torch.Tensor) -> int:
    falses = (~mask.bool()).nonzero()
    return int(falses[0]) if len(falses) else len(mask)
