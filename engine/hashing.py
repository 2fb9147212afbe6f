"""Block identity: the hash chain every process agrees on.

A full block of `block_size` tokens is identified by
``sha256(parent_hash || model_fingerprint || token_ids)``, starting from a fixed
root. The gateway, the router, both pools and the LMCache tier all call
:func:`block_hashes`, so a block cached anywhere is recognised everywhere.
Python's ``hash()`` is never used: it is salted per process.

A request's cache salt (a tenant's, or the client's `cache_salt`) replaces the root
(:func:`chain_root`): every block of a salted chain differs from every block of
another salt's, so the pool's prefix cache, the KV events, the prefix index and the
handoff are isolated per salt without knowing about salts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes

# Fixed root of every chain; changing it invalidates every cache and index.
ROOT_HASH: BlockHash = hashlib.sha256(b"duet-kv-root-v1").digest()


def chain_root(cache_salt: str | None) -> BlockHash:
    """The root of a request's hash chain: the fixed one without a salt."""
    if not cache_salt:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + b"salt:" + cache_salt.encode()).digest()


def salt_tag(cache_salt: str) -> str:
    """A salt as a short hex tag, for stores that key by name (the LMCache tiers):
    never the salt itself, which may be a secret."""
    return hashlib.sha256(b"duet-salt-tag:" + cache_salt.encode()).hexdigest()[:32]


def hash_block(parent: BlockHash, token_ids: Sequence[int], model_fingerprint: str) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    h = hashlib.sha256(parent)
    h.update(model_fingerprint.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids`; a trailing partial block has none."""
    parent = chain_root(cache_salt)
    out: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_fingerprint)
        out.append(parent)
    return out


def model_fingerprint(model_id: str, dtype: object, weight_quant: str = "none") -> str:
    """The hash salt of a model's blocks: KV from another model, dtype or weight
    quantization never matches.

    `dtype` is a torch dtype or its name (``torch.float32`` or ``"float32"``)."""
    fp = f"{model_id}|{str(dtype).removeprefix('torch.')}"
    return fp if weight_quant == "none" else f"{fp}|w{weight_quant}"
