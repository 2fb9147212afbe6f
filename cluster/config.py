"""The one typed config of a duet cluster (ARCHITECTURE.md, "Config").

Loaded from YAML, overridden by CLI flags, validated once at start: every error
names its field (pydantic's location, e.g. ``prefill.num_cpus``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import ConfigError, EngineConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineSection(Strict):
    model: str = "smollm2-135m"
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    block_size: int = Field(16, gt=0)
    max_num_seqs: int = Field(32, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    max_model_len: int = Field(2048, gt=0)
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_cache_bytes: int | None = Field(None, gt=0)
    enable_prefix_caching: bool = True

    def engine_config(self, threads: int | None) -> EngineConfig:
        data = self.model_dump(exclude={"served_model_name"})
        return EngineConfig(**data, num_threads=threads)


class AutoscalingPolicy(Strict):
    """Per-pool goodput-driven autoscaling bounds (None: fixed replica count)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class PoolConfig(Strict):
    replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, gt=0)
    threads: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(64, ge=1)
    autoscaling: AutoscalingPolicy | None = None
    # Overrides engine.num_kv_blocks for this pool only (e.g. a small decode pool).
    num_kv_blocks: int | None = Field(None, ge=2)


class TransferConfig(Strict):
    backend: Literal["nixl", "torch"] = "nixl"
    lease_ttl_s: float = Field(30.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)
    on_failure: Literal["error", "recompute"] = "error"


class RouterSection(Strict):
    """Replica choice for the pools (routing/request_router.py, routing/cost.py)."""

    # kv_aware: prefix- and load-aware routers; default: Serve's power-of-two choices.
    policy: Literal["kv_aware", "default"] = "kv_aware"
    overlap_weight: float = Field(1.0, ge=0)
    running_weight: float = Field(1.0, ge=0)
    temperature: float = Field(0.0, ge=0)
    imbalance_threshold: float = Field(64.0, gt=0)
    session_affinity_bonus: float = Field(8.0, ge=0)
    decode_kv_weight: float = Field(4.0, ge=0)
    prefix_index: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6390/0"
    index_key_prefix: str = "duet:prefix"
    stats_period_s: float = Field(0.25, gt=0)  # replicas' routing stats (load, KV event log)
    event_log_max_hashes: int = Field(4096, ge=16)  # memory index: compact the event log past this

    @model_validator(mode="after")
    def _redis(self):
        if not self.redis_url.startswith("redis://"):
            raise ValueError("router.redis_url must start with redis://")
        return self


class CacheSection(Strict):
    """LMCache tiers of the prefill pool; 0 / None turns a tier off."""

    cpu_bytes: int = Field(0, ge=0)
    disk_path: str | None = None
    disk_bytes: int = Field(0, ge=0)
    redis_url: str | None = None
    chunk_size: int = Field(256, gt=0)
    redis_retry_interval_s: float = Field(2.0, gt=0)  # probe a down Redis this often
    redis_timeout_s: float = Field(0.2, gt=0)

    @model_validator(mode="after")
    def _tiers(self):
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError("cache.disk_path and cache.disk_bytes must be set together")
        if self.redis_url is not None and not self.redis_url.startswith("redis://"):
            raise ValueError("cache.redis_url must start with redis://")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_bytes or (self.disk_path and self.disk_bytes) or self.redis_url)

    def tier_config(self):
        from prefill.kv_tier import KVTierConfig

        return KVTierConfig(
            cpu_bytes=self.cpu_bytes,
            disk_path=self.disk_path,
            disk_bytes=self.disk_bytes,
            redis_url=self.redis_url,
            chunk_size=self.chunk_size,
            redis_retry_interval_s=self.redis_retry_interval_s,
            redis_timeout_s=self.redis_timeout_s,
        )


class SLOSection(Strict):
    ttft_ms: float = Field(2000.0, gt=0)
    tpot_ms: float = Field(200.0, gt=0)


class GatewaySection(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    num_cpus: float = Field(0.25, gt=0)
    max_pending_requests: int = Field(256, ge=1)  # beyond this: 429


class TelemetrySection(Strict):
    otlp_endpoint: str | None = None
    service_name: str = "duet"
    console_spans: bool = False


class ClusterConfig(Strict):
    mode: Literal["disaggregated", "aggregated"] = "disaggregated"
    engine: EngineSection = EngineSection()
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    aggregated: PoolConfig = PoolConfig()
    transfer: TransferConfig = TransferConfig()
    router: RouterSection = RouterSection()
    cache: CacheSection = CacheSection()
    slo: SLOSection = SLOSection()
    gateway: GatewaySection = GatewaySection()
    telemetry: TelemetrySection = TelemetrySection()

    @model_validator(mode="after")
    def _combinations(self):
        e = self.engine
        if e.max_num_batched_tokens < e.block_size:
            raise ValueError("engine.max_num_batched_tokens must be >= engine.block_size")
        if self.cache.chunk_size % e.block_size:
            raise ValueError("cache.chunk_size must be a multiple of engine.block_size")
        return self

    @property
    def served_model_name(self) -> str:
        from engine.weights import SMOLLM2_ID, resolve_checkpoint

        if self.engine.served_model_name:
            return self.engine.served_model_name
        if self.engine.model == "smollm2-135m":
            return SMOLLM2_ID
        return resolve_checkpoint(self.engine.model).model_id

    def pools(self) -> dict[str, PoolConfig]:
        if self.mode == "aggregated":
            return {"aggregated": self.aggregated}
        return {"prefill": self.prefill, "decode": self.decode}

    def required_cpus(self) -> float:
        """CPUs the Serve app reserves at its initial size."""
        return self.gateway.num_cpus + sum(p.replicas * p.num_cpus for p in self.pools().values())

    def check_fits(self, available_cpus: float) -> None:
        """Serve hangs silently when replicas need more CPUs than exist: fail first."""
        need = self.required_cpus()
        if need > available_cpus + 1e-9:
            parts = ", ".join(f"{n}.replicas x {n}.num_cpus = {p.replicas * p.num_cpus:g}" for n, p in self.pools().items())
            raise ConfigError(
                "num_cpus",
                f"the pools need {need:g} CPUs ({parts}, gateway.num_cpus = {self.gateway.num_cpus:g}) "
                f"but the Ray cluster has {available_cpus:g}",
            )


def _set_path(data: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, object] | None = None) -> ClusterConfig:
    """YAML file (optional), then dotted overrides (``prefill.replicas: 2``)."""
    data: dict = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(str(path), "the config file must be a mapping")
        data = loaded or {}
    for k, v in (overrides or {}).items():
        if v is not None:
            _set_path(data, k, v)
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "config"
        raise ConfigError(field, err["msg"]) from None
