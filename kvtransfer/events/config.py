"""Where a pool's KV events go and where routers read them (part of the cluster
config's `router:` section; the pool replicas publish, the routers consume)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PrefixIndexConfig(BaseModel):
    """The prefix index's transport: `memory` (event logs in routing stats) or `redis`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix_index: Literal["memory", "redis"] = "memory"
    # redis:// or rediss:// (TLS); a password goes in the URL (redis://:PASSWORD@host:port/db).
    redis_url: str = "redis://127.0.0.1:6390/0"
    index_key_prefix: str = "duet:prefix"
    # memory: compact a replica's event log once it has recorded this many hashes.
    event_log_max_hashes: int = Field(4096, ge=16)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://")):
            raise ValueError("must start with redis:// or rediss://")
        return url

    def of_pool(self, pool: str) -> PrefixIndexConfig:
        """The index of one pool's replicas: the prefill pool's under the configured key
        prefix, the decode pool's beside it (its own keys: a prefill router that clears
        replicas it does not know must not touch decode's)."""
        if pool == "prefill":
            return self
        return self.model_copy(update={"index_key_prefix": f"{self.index_key_prefix}-{pool}"})
