"""Settings of the OpenAI gateway (the cluster config's `gateway:` section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GatewayConfig(BaseModel):
    """Where the gateway listens and how much it admits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    num_cpus: float = Field(0.25, gt=0)
    # Requests inside the gateway at once; beyond this a new one gets a 429.
    max_pending_requests: int = Field(256, ge=1)
