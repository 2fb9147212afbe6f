"""When sessions start: open loop at a rate, closed loop at a concurrency, or the
times a trace recorded; and sweeps over rates or concurrencies.

Open-loop inter-arrival gaps follow `vllm bench serve`: a gamma distribution with
shape = burstiness and scale = 1 / (rate * burstiness), so the mean rate is `rate`
for any burstiness; burstiness 1 is Poisson, < 1 is burstier, > 1 smoother.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ArrivalProcess:
    """One sweep point's arrival process. Exactly one of `rate` (open loop; inf means
    all at once) or `concurrency` (closed loop) is set, unless `trace` is True."""

    rate: float | None = None
    concurrency: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    trace: bool = False

    def __post_init__(self) -> None:
        if not self.trace and (self.rate is None) == (self.concurrency is None):
            raise ValueError("set exactly one of rate (open loop) or concurrency (closed loop)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"request rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None

    @property
    def label(self) -> str:
        if self.trace:
            return "trace"
        if self.closed_loop:
            return f"concurrency={self.concurrency}"
        return f"rate={self.rate:g}"

    @property
    def x_value(self) -> float:
        """The swept quantity (offered rate or concurrency) for plots."""
        if self.trace:
            return 0.0
        return float(self.concurrency if self.closed_loop else self.rate)

    def describe(self) -> dict[str, Any]:
        if self.trace:
            return {"kind": "trace"}
        if self.closed_loop:
            return {"kind": "closed", "concurrency": self.concurrency}
        kind = "poisson" if self.burstiness == 1.0 else "gamma"
        return {"kind": kind, "rate": self.rate, "burstiness": self.burstiness}

    def start_times(self, n: int) -> np.ndarray:
        """Offsets (s) from the benchmark start of n open-loop arrivals."""
        if self.closed_loop or self.trace:
            raise ValueError("start_times is for open-loop arrivals")
        return np.cumsum(inter_arrival_gaps(self.rate, n, self.burstiness, self.seed))


def inter_arrival_gaps(rate: float, n: int, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """n seeded gaps (s). The first arrival is at time 0, as in vllm bench serve."""
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return gaps


def sweep(
    rates: list[float] | None = None,
    concurrencies: list[int] | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[ArrivalProcess]:
    """The sweep points, in the order given. Giving both lists is an error: a point
    is either open or closed loop. Neither gives one open-loop point at rate inf."""
    if rates and concurrencies:
        raise ValueError("give request rates or concurrencies, not both")
    if concurrencies:
        return [ArrivalProcess(concurrency=c, seed=seed) for c in concurrencies]
    return [ArrivalProcess(rate=r, burstiness=burstiness, seed=seed) for r in (rates or [math.inf])]


def parse_rate(s: str) -> float:
    return math.inf if s.lower() in ("inf", "infinity") else float(s)
