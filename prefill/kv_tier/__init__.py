"""The prefill pool's LMCache-backed KV tier (CPU, disk, Redis).

`config` (the `cache:` settings), `tier` (`KVTier`, the engine's ExternalKVCache),
`connector` (LMCache <-> the paged KV tensor), `lmcache_compat` (what LMCache needs
to work outside vLLM), `health` (Redis up or down), `stats` (counters). Only
`tier` and `connector` import LMCache.
"""
