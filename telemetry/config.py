"""`telemetry:` settings: where traces go, how many are kept.

Tracing is off by default. It turns on when `tracing: true`, or when the standard
OpenTelemetry variables name an endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) in the environment of `duet serve`: the
driver resolves them once (`resolved()`) and every replica gets the result, so a
worker started before the variable was set still traces.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Protocol = Literal["http/protobuf", "grpc"]


class TelemetryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tracing: bool = False
    # OTLP collector: http/protobuf takes a base URL (…:4318, `/v1/traces` is added),
    # grpc a host:port URL (…:4317). None with `tracing: true` and `console: false`
    # means the OTLP exporter's own default (localhost).
    otlp_endpoint: str | None = None
    otlp_protocol: Protocol = "http/protobuf"
    otlp_headers: dict[str, str] = Field(default_factory=dict)
    console: bool = False  # also print spans to the replica's stdout (debugging)
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)  # of new traces; a sampled parent is always kept
    service_name: str = "duet"
    # How long finished spans wait in a process before they are exported in a batch.
    export_delay_ms: int = Field(2000, ge=10, le=60_000)

    def resolved(self, env: Mapping[str, str] | None = None) -> TelemetryConfig:
        """These settings with the standard `OTEL_*` variables applied (they win only
        where the config left the default)."""
        env = os.environ if env is None else env
        if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return self.model_copy(update={"tracing": False})
        update: dict = {}
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint and self.otlp_endpoint is None:
            update |= {"tracing": True, "otlp_endpoint": endpoint}
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol in ("http/protobuf", "grpc") and "otlp_protocol" not in self.model_fields_set:
            update["otlp_protocol"] = protocol
        ratio = env.get("OTEL_TRACES_SAMPLER_ARG")
        if ratio and "sample_ratio" not in self.model_fields_set:
            update["sample_ratio"] = min(1.0, max(0.0, float(ratio)))
        name = env.get("OTEL_SERVICE_NAME")
        if name and "service_name" not in self.model_fields_set:
            update["service_name"] = name
        return self.model_copy(update=update)
