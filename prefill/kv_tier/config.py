"""Settings of the prefill pool's LMCache tiers (the cluster config's `cache:` section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.external_kv import ExternalKVSpec


class KVTierConfig(BaseModel):
    """Which tiers are on and how big; 0 / None turns a tier off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_bytes: int = Field(0, ge=0)
    disk_path: str | None = None
    disk_bytes: int = Field(0, ge=0)
    # redis:// only: LMCache 0.5.6's Redis connector speaks neither TLS nor rediss://.
    redis_url: str | None = None
    # Tokens per LMCache chunk: a multiple of the engine's block size (checked with it).
    chunk_size: int = Field(256, gt=0)
    # While Redis answers, re-check it this often; while it is down, probe this often.
    redis_check_interval_s: float = Field(0.5, gt=0)
    redis_retry_interval_s: float = Field(2.0, gt=0)
    redis_timeout_s: float = Field(0.2, gt=0)
    # LMCache's shutdown can hang; a replica stops waiting for it after this long.
    close_timeout_s: float = Field(5.0, gt=0)
    # Every key (Redis) and file (disk) of this cluster's tier starts with it: clusters
    # sharing one Redis or one disk stay apart. Letters, digits and '-' only (LMCache
    # splits keys at '@' and '/').
    namespace: str = Field("duet", pattern=r"^[A-Za-z0-9-]{1,64}$")

    @model_validator(mode="after")
    def _tiers(self) -> KVTierConfig:
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError("disk_path and disk_bytes must be set together")
        if self.redis_url is not None and not self.redis_url.startswith("redis://"):
            raise ValueError("redis_url must start with redis://")
        return self

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.disk_path is not None or self.redis_url is not None

    def external_kv_spec(self) -> ExternalKVSpec:
        """The tier as the engine's runner builds it (a thread's or a child process's)."""
        return ExternalKVSpec("prefill.kv_tier.tier:build_tier", self.model_dump(), self.close_timeout_s)
