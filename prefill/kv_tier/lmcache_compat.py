"""What LMCache 0.5.6 needs to work as duet's tier outside vLLM, in one place.

- Chunk keys: without vLLM, LMCache hashes token chunks with Python's salted
  `hash()`; `stable_chunk_hash` replaces it so every process derives the same keys.
- `RedisConnector.close()` runs a blocking executor shutdown inside its own event
  loop and deadlocks at shutdown; `patch_redis_connector_close` shuts down without
  waiting.
- The disk backend keeps its index in memory only, so a restarted replica would
  ignore its own disk tier; `recover_disk_index` re-indexes the chunk files.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def stable_chunk_hash(obj: tuple[int, tuple[int, ...], tuple[Any, ...]]) -> int:
    """Replaces LMCache's fallback `hash()`: same value in every process."""
    prefix, tokens, extra = obj
    h = hashlib.sha256(int(prefix).to_bytes(16, "little", signed=True))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(repr(extra).encode())
    return int.from_bytes(h.digest()[:8], "little")


def patch_redis_connector_close() -> None:
    """Make `RedisConnector.close()` shut its executor down without waiting (idempotent)."""
    from lmcache.v1.storage_backend.connector import redis_connector as rc

    if getattr(rc.RedisConnector.close, "_duet_patched", False):
        return

    async def close(self) -> None:
        await self.pq_executor.shutdown_async(wait=False)
        await self.connection.close()

    close._duet_patched = True  # type: ignore[attr-defined]
    rc.RedisConnector.close = close


def recover_disk_index(engine, metadata, chunk_size: int, kv: torch.Tensor, backend_name: str) -> int:
    """Re-index chunk files a previous process left in the disk tier's folder.

    Files are named by their key; only this model's full-chunk files of the expected
    size and dtype are taken, oldest first, up to the tier's size. Returns how many.
    """
    from lmcache.utils import CacheEngineKey

    backend = engine.storage_manager.storage_backends[backend_name]
    shape = metadata.get_shapes(chunk_size)[0]
    size = shape.numel() * kv.element_size()
    model = metadata.model_name
    stem = model + "@"
    try:
        entries = [e for e in os.scandir(backend.path) if e.name.endswith(".pt")]
    except OSError as exc:
        log.warning("KV tier: cannot scan disk tier %s: %s", backend.path, exc)
        return 0
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
        if key.dtype != kv.dtype:
            continue
        backend.insert_key(key, size, shape, kv.dtype, engine.fmt)
        backend.current_cache_size += size
        backend.usage += size
        recovered += 1
    if recovered:
        log.info("KV tier: re-indexed %d chunks from disk tier %s", recovered, backend.path)
    return recovered
