"""The autoscaling settings: `autoscaling:` of each pool, and the cluster-wide `slo:`
and `budget:` sections. Capacity profiles (what `duet plan` fits) are read here too,
so the policy gets numbers, not a path the Serve controller may not see."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SLOConfig(Strict):
    """What a good request is: its TTFT and TPOT at the gateway within these bounds.
    `goodput_target` is the fraction of requests that must be good; the policy checks
    latencies at that quantile (0.9: p90)."""

    ttft_ms: float = Field(2000.0, gt=0)
    tpot_ms: float = Field(200.0, gt=0)
    goodput_target: float = Field(0.9, gt=0, lt=1)


class BudgetConfig(Strict):
    """What all autoscaled pools may hold together (None: no limit). When both pools
    want more than this, it is split in proportion to what each wants."""

    cpus: float | None = Field(None, gt=0)
    gpus: float | None = Field(None, gt=0)


class PrefillProfile(Strict):
    """Per-replica prefill service time: a + b x prompt tokens."""

    a_ms: float = Field(0.0, ge=0)
    b_ms_per_token: float = Field(gt=0)

    def tokens_per_s(self, mean_prompt_tokens: float = 256.0) -> float:
        return mean_prompt_tokens / ((self.a_ms + self.b_ms_per_token * mean_prompt_tokens) / 1e3)


class DecodeProfile(Strict):
    """Per-replica decode step time: c + d x batch (the TPOT at that batch)."""

    c_ms: float = Field(ge=0)
    d_ms_per_seq: float = Field(gt=0)
    max_batch: int = Field(256, ge=1)

    def max_batch_within(self, tpot_ms: float) -> int:
        """The largest batch whose step stays within `tpot_ms` (at least 1)."""
        return max(1, min(self.max_batch, int((tpot_ms - self.c_ms) / self.d_ms_per_seq)))


class CapacityProfile(Strict):
    """The fitted models of `duet plan` (its JSON's `plan.prefill_model` and
    `plan.decode_model`, or a file with just those two keys)."""

    prefill_model: PrefillProfile | None = None
    decode_model: DecodeProfile | None = None

    @classmethod
    def load(cls, path: str | Path) -> CapacityProfile:
        data = json.loads(Path(path).read_text())
        if "plan" in data:
            data = data["plan"]
        return cls.model_validate({k: data.get(k) for k in ("prefill_model", "decode_model")})


class PoolAutoscaling(Strict):
    """How one pool is scaled.

    - `goodput`: duet's policy (autoscaling/policy.py) from the pool's signals, the
      gateway's latencies and the capacity profile;
    - `queue`: Ray Serve's own rule (ongoing requests per replica against
      `target_ongoing_requests`), kept for comparison;
    - `fixed`: the pool's `replicas`, never changed.
    """

    policy: Literal["goodput", "queue", "fixed"] = "goodput"
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    # At most this many replicas added or removed by one decision.
    max_step: int = Field(1, ge=1)
    # A change is made only after the policy has wanted it for this long (seconds).
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    # A new replica's latency and capacity samples are ignored for this long.
    warmup_s: float = Field(10.0, ge=0)
    # The load a replica is planned for, as a fraction of its capacity.
    target_utilization: float = Field(0.8, gt=0, le=1)
    # What `duet plan` fitted: its JSON file, or the numbers inline (what a Helm values
    # file or the generated Serve config carries: the controller may not see the file).
    profile: str | CapacityProfile | None = None
    # How often the pool's replicas report their signals to the Serve controller.
    signal_interval_s: float = Field(2.0, gt=0)
    # The `queue` policy's target.
    target_ongoing_requests: float = Field(8.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if isinstance(self.profile, str) and not Path(self.profile).is_file():
            raise ValueError(f"profile {self.profile!r} is not a file")
        return self

    def load_profile(self) -> CapacityProfile:
        if isinstance(self.profile, CapacityProfile):
            return self.profile
        return CapacityProfile.load(self.profile) if self.profile else CapacityProfile()
