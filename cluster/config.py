"""The one typed config of a duet cluster: each room's settings, composed.

Every section is the model of the room that reads it (`engine:` engine/config.py,
`transfer:` kvtransfer/config.py, `router:` routing/router/policy.py, `cache:`
prefill/kv_tier/config.py, `gateway:` routing/openai/config.py, `telemetry:`
telemetry/config.py); the pools' sizing and placement is cluster/pools.py. This
module adds the checks that span rooms and is where YAML and flags enter. Every
error names its field (e.g. ``prefill.num_cpus``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from autoscaling.config import BudgetConfig, SLOConfig
from cluster.pools import INGRESS_POOL, POOLS_BY_MODE, PoolConfig
from engine.config import ConfigError, EngineConfig
from engine.external_kv import check_chunk_size
from kvtransfer.config import TransferConfig
from prefill.kv_tier.config import KVTierConfig
from routing.openai.config import GatewayConfig
from routing.router.policy import RouterConfig
from telemetry.config import TelemetryConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterConfig(Strict):
    mode: Literal["disaggregated", "aggregated"] = "disaggregated"
    engine: EngineConfig = EngineConfig()
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    aggregated: PoolConfig = PoolConfig()
    transfer: TransferConfig = TransferConfig()
    router: RouterConfig = RouterConfig()
    cache: KVTierConfig = KVTierConfig()
    gateway: GatewayConfig = GatewayConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    # What the goodput autoscaling policy holds the ingress replicas' latencies to, and what
    # the autoscaled pools may hold together.
    slo: SLOConfig = SLOConfig()
    budget: BudgetConfig = BudgetConfig()

    @model_validator(mode="after")
    def _across_rooms(self):
        try:
            check_chunk_size(self.cache.chunk_size, self.engine.block_size)
        except ValueError as e:
            raise ValueError(f"cache.chunk_size: {e}") from None
        if self.mode == "aggregated" and self.aggregated.scaling == "goodput":
            # One pool doing both phases has no prefill or decode signals of its own.
            raise ValueError("aggregated.autoscaling.policy: goodput scales a prefill and a decode pool; "
                             "use queue or fixed in aggregated mode")
        if self._kv_aware_among_several() and self.gateway.ingress != "haproxy":
            # Serve's Python proxy picks the ingress replica by load alone; only HAProxy
            # asks an ingress request router, which can read the prompt.
            raise ValueError("gateway.ingress: with more than one aggregated replica the KV-aware router "
                             "chooses among them only behind gateway.ingress: haproxy; use that, "
                             "router.policy: default, or one replica")
        return self

    def _kv_aware_among_several(self) -> bool:
        pool = self.aggregated
        several = pool.replicas > 1 if pool.scaling == "fixed" else pool.autoscaling.max_replicas > 1
        return self.mode == "aggregated" and several and self.router.policy == "kv_aware"

    def ingress_deployment(self) -> str:
        """The deployment that takes the HTTP requests: the pool whose replicas stream
        the tokens (aggregated, or decode in P/D), each with the gateway inside."""
        return INGRESS_POOL[self.mode]

    def routes_at_ingress(self) -> bool:
        """Whether HAProxy asks the ingress request router (routing/router/ingress.py)
        which ingress replica (aggregated, or decode in P/D) takes each request: the
        pool router's KV-aware choice. Whatever the pool's size: a Serve config carries
        the size apart from this config (cluster/serve_config.py), and an operator may
        change it there. One replica has nothing to choose; `router.policy: default`
        spares it the hop."""
        return self.gateway.ingress == "haproxy" and self.router.policy == "kv_aware"

    def scaled_pools(self, policy: str) -> dict[str, PoolConfig]:
        """The pools whose `autoscaling.policy` is `policy`."""
        return {n: p for n, p in self.pools().items() if p.scaling == policy}

    def pool_engine(self, pool: PoolConfig) -> EngineConfig:
        """The engine settings of one pool's replicas (its own KV pool size, if set)."""
        if pool.num_kv_blocks is None:
            return self.engine
        return self.engine.replace(num_kv_blocks=pool.num_kv_blocks)

    def pools(self) -> dict[str, PoolConfig]:
        return {name: getattr(self, name) for name in POOLS_BY_MODE[self.mode]}

    def required_cpus(self, at_most: bool = False) -> float:
        """CPUs the Serve app reserves at its initial size (`at_most`: with every
        autoscaled pool at its `max_replicas`)."""
        def replicas(p: PoolConfig) -> int:
            return p.autoscaling.max_replicas if at_most and p.scaling != "fixed" else p.initial_replicas()
        ingress = replicas(self.pools()[self.ingress_deployment()]) * self.gateway.num_cpus  # the gateway in each
        return ingress + sum(replicas(p) * p.num_cpus for p in self.pools().values())

    def check_fits(self, available_cpus: float) -> None:
        """Serve hangs silently when replicas need more CPUs than exist: fail first."""
        need = self.required_cpus()
        if need > available_cpus + 1e-9:
            parts = ", ".join(f"{n}.replicas x {n}.num_cpus = {p.initial_replicas() * p.num_cpus:g}"
                              for n, p in self.pools().items())
            raise ConfigError(
                "num_cpus",
                f"the pools need {need:g} CPUs ({parts}, gateway.num_cpus = {self.gateway.num_cpus:g} "
                f"in each {self.ingress_deployment()} replica) "
                f"but the Ray cluster has {available_cpus:g}",
            )


def _set_path(data: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value


def _resolve_profiles(data: dict, base: Path) -> None:
    """A pool's `autoscaling.profile` in a config file is relative to that file."""
    for pool in ("prefill", "decode", "aggregated"):
        section = data.get(pool)
        scaling = section.get("autoscaling") if isinstance(section, dict) else None
        profile = scaling.get("profile") if isinstance(scaling, dict) else None
        if isinstance(profile, str) and not Path(profile).is_absolute():
            scaling["profile"] = str(base / profile)


def load_config(path: str | Path | None = None, overrides: dict[str, object] | None = None) -> ClusterConfig:
    """YAML file (optional), then dotted overrides (``prefill.replicas: 2``)."""
    data: dict = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(str(path), "the config file must be a mapping")
        data = loaded or {}
        _resolve_profiles(data, Path(path).parent)
    for k, v in (overrides or {}).items():
        if v is not None:
            _set_path(data, k, v)
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "config"
        raise ConfigError(field, err["msg"]) from None
