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
    # API keys: this file (one per line) and/or DUET_API_KEYS; none at all = an open gateway.
    api_keys_file: str | None = None
    # Whether /metrics needs a key too (/health and /ready never do).
    metrics_require_key: bool = False
    # Per key: requests in flight, and tokens (prompt + max_tokens) per minute. None: no limit.
    max_in_flight_per_key: int | None = Field(None, ge=1)
    tokens_per_minute_per_key: int | None = Field(None, ge=1)
    # A larger request body is refused with 413 before it is parsed.
    max_body_bytes: int = Field(4 << 20, ge=1024)
