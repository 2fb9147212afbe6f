"""KV tier beyond one replica's block pool: LMCache over local CPU, local disk, Redis.

A prefill replica looks a prompt up here after its own block pool misses
(ARCHITECTURE.md, step 3), loads the cached prefix into freshly allocated
blocks, and stores newly computed *full blocks* afterwards. Chunks are
`chunk_size` tokens (a multiple of the block size); only whole chunks are
stored and found, so a hit always ends on a block boundary.

Ownership: the tier never frees or allocates blocks. The caller passes a block
table it owns for the duration of the call; `retrieve` writes into those blocks,
`store` only reads them.

Failure policy: Redis is optional at runtime. Before touching it the tier checks
it with a fail-fast ping (cached for `redis_check_interval_s`); if it is down,
the Redis backend is bypassed (counted in `stats.redis.skipped`, logged), CPU and
disk keep working, and Redis is probed again every `redis_retry_interval_s`.

Hash seed: LMCache keys chunks by a hash chain. Without vLLM it falls back to
Python's `hash()`; we replace it with a sha256-based function, so keys agree
across processes whatever PYTHONHASHSEED is (set PYTHONHASHSEED=0 anyway, as
LMCache's own docs ask).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from prefill.lmcache_connector import PagedKVConnector

log = logging.getLogger(__name__)

CPU_BACKEND, DISK_BACKEND, REDIS_BACKEND = "LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"
_TIERS = (("cpu", CPU_BACKEND), ("disk", DISK_BACKEND), ("redis", REDIS_BACKEND))


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """Which tiers are on and how big; 0 / None turns a tier off."""

    cpu_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0
    redis_url: str | None = None
    chunk_size: int = 256
    redis_check_interval_s: float = 0.5
    redis_retry_interval_s: float = 2.0
    redis_timeout_s: float = 0.2
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0:
            raise ValueError(f"KVTierConfig.cpu_bytes must be >= 0, got {self.cpu_bytes}")
        if self.chunk_size <= 0:
            raise ValueError(f"KVTierConfig.chunk_size must be > 0, got {self.chunk_size}")
        if (self.disk_path is None) != (self.disk_bytes <= 0):
            raise ValueError("KVTierConfig.disk_path and disk_bytes must be set together")
        if self.redis_url is not None and not self.redis_url.startswith("redis://"):
            raise ValueError(f"KVTierConfig.redis_url must start with redis://, got {self.redis_url!r}")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.disk_path is not None or self.redis_url is not None


@dataclass(slots=True)
class TierStats:
    """Counters for one tier. `hit_tokens` counts tokens served from this tier."""

    hit_tokens: int = 0
    hit_bytes: int = 0
    retrieve_s: float = 0.0
    skipped: int = 0  # operations that left this tier out because it was down
    errors: int = 0


@dataclass(slots=True)
class KVTierStats:
    lookups: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    retrieves: int = 0
    retrieved_tokens: int = 0
    stores: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    store_s: float = 0.0
    lookup_s: float = 0.0
    tiers: dict[str, TierStats] = field(
        default_factory=lambda: {name: TierStats() for name, _ in _TIERS}
    )

    @property
    def cpu(self) -> TierStats:
        return self.tiers["cpu"]

    @property
    def disk(self) -> TierStats:
        return self.tiers["disk"]

    @property
    def redis(self) -> TierStats:
        return self.tiers["redis"]


def _stable_chunk_hash(obj: tuple[int, tuple[int, ...], tuple[Any, ...]]) -> int:
    """Replaces LMCache's fallback `hash()`: same value in every process."""
    prefix, tokens, extra = obj
    h = hashlib.sha256(int(prefix).to_bytes(16, "little", signed=True))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(repr(extra).encode())
    return int.from_bytes(h.digest()[:8], "little")


def _patch_redis_connector_close() -> None:
    """LMCache 0.5.6's RedisConnector.close() runs a *blocking* executor shutdown
    on its own event loop and deadlocks (FINDINGS.md). Shut down without waiting."""
    from lmcache.v1.storage_backend.connector import redis_connector as rc

    if getattr(rc.RedisConnector.close, "_duet_patched", False):
        return

    async def close(self) -> None:
        await self.pq_executor.shutdown_async(wait=False)
        await self.connection.close()

    close._duet_patched = True  # type: ignore[attr-defined]
    rc.RedisConnector.close = close


class KVTier:
    """Owns one replica's LMCache engine and its view of the paged KV tensor."""

    def __init__(self, config: KVTierConfig, kv: torch.Tensor, model_fingerprint: str) -> None:
        if not config.enabled:
            raise ValueError("KVTier needs at least one tier on (cpu_bytes, disk_path or redis_url)")
        block_size = kv.shape[3]
        if config.chunk_size % block_size:
            raise ValueError(
                f"KVTierConfig.chunk_size ({config.chunk_size}) must be a multiple of "
                f"the block size ({block_size})"
            )
        os.environ.setdefault("PYTHONHASHSEED", "0")
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        _patch_redis_connector_close()
        self.config = config
        self.kv = kv
        self.block_size = block_size
        self.stats = KVTierStats()
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
            model_name="duet-" + hashlib.sha256(model_fingerprint.encode()).hexdigest()[:16],
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
        self._engine.token_database.hash_func = _stable_chunk_hash
        self._metadata = metadata
        self._backends = set(self._engine.storage_manager.storage_backends)
        if DISK_BACKEND in self._backends:
            self._recover_disk_index()
        self._redis_probe = None
        self._redis_up = True
        self._redis_next_check = 0.0
        if config.redis_url is not None:
            self._redis_probe = _fail_fast_redis(config.redis_url, config.redis_timeout_s)
            self._check_redis(force=True)
        self._closed = False

    def _recover_disk_index(self) -> None:
        """Re-index chunk files a previous process left in `disk_path`.

        LMCache 0.5.6 writes one file per chunk but keeps its index in memory
        only, so a restarted replica would ignore its own disk tier. Files are
        named by their key; only this model's full-chunk files of the expected
        size are taken, oldest first, up to `disk_bytes`.
        """
        from lmcache.utils import CacheEngineKey

        backend = self._engine.storage_manager.storage_backends[DISK_BACKEND]
        shape = self._metadata.get_shapes(self.config.chunk_size)[0]
        size = shape.numel() * self.kv.element_size()
        model = self._metadata.model_name
        stem = model + "@"
        try:
            entries = [e for e in os.scandir(backend.path) if e.name.endswith(".pt")]
        except OSError as exc:
            log.warning("KV tier: cannot scan disk tier %s: %s", backend.path, exc)
            return
        entries.sort(key=lambda e: e.stat().st_mtime)
        recovered = 0
        for e in entries:
            name = e.name[: -len(".pt")]
            if not name.startswith(stem) or e.stat().st_size != size:
                continue
            if backend.current_cache_size + size > backend.max_cache_size:
                break
            try:
                key = CacheEngineKey.from_string(model + "@" + name[len(stem) :])
            except ValueError:
                continue
            if key.dtype != self.kv.dtype:
                continue
            backend.insert_key(key, size, shape, self.kv.dtype, self._engine.fmt)
            backend.current_cache_size += size
            backend.usage += size
            recovered += 1
        if recovered:
            log.info("KV tier: re-indexed %d chunks from disk tier %s", recovered, backend.path)

    def _tier_on(self, backend: str) -> bool:
        if backend not in self._backends:
            return False
        if backend == CPU_BACKEND:
            return self.config.cpu_bytes > 0  # otherwise only a staging area
        return backend != REDIS_BACKEND or self._redis_up

    def _check_redis(self, force: bool = False) -> None:
        """Bypass the Redis backend while Redis does not answer; restore it when it does."""
        if self._redis_probe is None:
            return
        now = time.monotonic()
        if not force and now < self._redis_next_check:
            if not self._redis_up:
                self.stats.redis.skipped += 1
            return
        try:
            self._redis_probe.ping()
            up = True
        except Exception as exc:  # noqa: BLE001 - any failure means "down"
            up = False
            self.stats.redis.errors += 1
            if self._redis_up:
                log.warning("KV tier: Redis at %s unreachable, skipping it: %s", self.config.redis_url, exc)
        if up and not self._redis_up:
            log.info("KV tier: Redis at %s is back", self.config.redis_url)
        self._redis_up = up
        self._redis_next_check = now + (
            self.config.redis_check_interval_s if up else self.config.redis_retry_interval_s
        )
        if REDIS_BACKEND in self._backends:
            self._engine.storage_manager.set_backend_bypass(REDIS_BACKEND, not up)
        if not up:
            self.stats.redis.skipped += 1

    def _lookup_tiers(self, tokens: torch.Tensor) -> dict[str, int]:
        """Cached prefix length in each tier that is on."""
        return {
            name: self._engine.lookup(tokens, search_range=[backend])
            for name, backend in _TIERS
            if self._tier_on(backend)
        }

    def lookup(self, token_ids) -> int:
        """Tokens of `token_ids`' prefix available in any tier (a multiple of chunk_size)."""
        tokens = torch.as_tensor(token_ids, dtype=torch.long)
        with self._lock:
            self._check_redis()
            t0 = time.perf_counter()
            per_tier = self._lookup_tiers(tokens)
            found = max(per_tier.values(), default=0)
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(tokens)
            self.stats.lookup_hit_tokens += found
            self.stats.lookup_s += time.perf_counter() - t0
            return found

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def retrieve(self, token_ids, block_table, num_tokens: int, start: int = 0) -> int:
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
            per_tier = self._lookup_tiers(tokens)
            t0 = time.perf_counter()
            ret = self._engine.retrieve(tokens, mask=mask, block_table=_as_table(block_table))
            elapsed = time.perf_counter() - t0
            loaded = start + _leading_true(ret[start:])
            self.stats.retrieves += 1
            self.stats.retrieved_tokens += loaded - start
            # Backends are read in order CPU, disk, Redis: attribute each token
            # to the first tier that holds it.
            covered = start
            bytes_per_token = self._bytes_per_token()
            for name, _ in _TIERS:
                upto = min(per_tier.get(name, 0), loaded)
                if upto > covered:
                    t = self.stats.tiers[name]
                    t.hit_tokens += upto - covered
                    t.hit_bytes += (upto - covered) * bytes_per_token
                    t.retrieve_s += elapsed * (upto - covered) / (loaded - start)
                    covered = upto
            return loaded

    # ExternalKVCache (engine/external_kv.py): the engine's view of this tier.
    def load(self, token_ids, block_ids, start: int, end: int) -> int:
        return self.retrieve(token_ids, block_ids, end, start)

    def as_dict(self) -> dict:
        """Flat counters for `stats()` and Prometheus: kv_tier_<tier>_<counter>."""
        st = self.stats
        out = {
            f"kv_tier_{k}": getattr(st, k)
            for k in ("lookups", "lookup_tokens", "lookup_hit_tokens", "retrieves", "retrieved_tokens",
                      "stores", "stored_tokens", "stored_bytes", "store_s", "lookup_s")
        }
        for name, t in st.tiers.items():
            for k in ("hit_tokens", "hit_bytes", "retrieve_s", "skipped", "errors"):
                out[f"kv_tier_{name}_{k}"] = getattr(t, k)
        out["kv_tier_redis_up"] = int(self._redis_up) if self._redis_probe is not None else None
        return out

    def store(self, token_ids, block_table, num_tokens: int) -> int:
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
            self._engine.store(tokens, block_table=_as_table(block_table))
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
        if self._redis_probe is not None:
            self._redis_probe.close()

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_table(block_table) -> torch.Tensor:
    return torch.as_tensor(block_table, dtype=torch.long)


def _leading_true(mask: torch.Tensor) -> int:
    falses = (~mask.bool()).nonzero()
    return int(falses[0]) if len(falses) else len(mask)


def _fail_fast_redis(url: str, timeout_s: float):
    """A health probe that neither retries nor waits long."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
