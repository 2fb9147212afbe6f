"""Counters of the KV tier, per tier and overall."""

from __future__ import annotations

from dataclasses import dataclass, field

# Tier name -> LMCache storage backend, in the order LMCache reads them.
CPU_BACKEND, DISK_BACKEND, REDIS_BACKEND = "LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"
TIERS = (("cpu", CPU_BACKEND), ("disk", DISK_BACKEND), ("redis", REDIS_BACKEND))


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
    tiers: dict[str, TierStats] = field(default_factory=lambda: {name: TierStats() for name, _ in TIERS})

    @property
    def cpu(self) -> TierStats:
        return self.tiers["cpu"]

    @property
    def disk(self) -> TierStats:
        return self.tiers["disk"]

    @property
    def redis(self) -> TierStats:
        return self.tiers["redis"]

    def as_dict(self) -> dict[str, float]:
        """Flat counters for `stats()` and Prometheus: kv_tier_<counter>, kv_tier_<tier>_<counter>."""
        out: dict[str, float] = {
            f"kv_tier_{k}": getattr(self, k)
            for k in ("lookups", "lookup_tokens", "lookup_hit_tokens", "retrieves", "retrieved_tokens",
                      "stores", "stored_tokens", "stored_bytes", "store_s", "lookup_s")
        }
        for name, t in self.tiers.items():
            for k in ("hit_tokens", "hit_bytes", "retrieve_s", "skipped", "errors"):
                out[f"kv_tier_{name}_{k}"] = getattr(t, k)
        return out
