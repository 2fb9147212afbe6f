"""Length distributions for prompts and outputs, parsed from compact specs.

Spec grammar (tokens): `N` or `fixed:N`, `uniform:LO:HI` (inclusive),
`normal:MEAN:STD`, `lognormal:MEAN:SIGMA` (MEAN is the arithmetic mean in tokens,
SIGMA the standard deviation of the underlying normal). Samples are integers
clipped to [min_value, max_value] so a wide normal never asks for 0 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """A seeded-sampler-agnostic description of a token-length distribution."""

    kind: str
    a: float
    b: float = 0.0
    min_value: int = 1
    max_value: int = 1 << 20

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"length distribution kind {self.kind!r} not in {KINDS}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform:{self.a}:{self.b}: HI must be >= LO")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"length distribution {self.spec}: negative parameter")

    @property
    def spec(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"

    @property
    def mean(self) -> float:
        """Mean before clipping (used by the planner's first guesses)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b, size=n)
        else:
            mu = math.log(max(self.a, 1e-9)) - self.b**2 / 2
            x = rng.lognormal(mu, self.b, size=n)
        return np.clip(np.rint(x), self.min_value, self.max_value).astype(np.int64)


def parse_length(spec: str | int, min_value: int = 1) -> LengthDist:
    """Parse `512`, `fixed:512`, `uniform:100:200`, `normal:256:64`,
    `lognormal:256:0.5`."""
    s = str(spec).strip()
    parts = s.split(":")
    try:
        if len(parts) == 1:
            return LengthDist("fixed", float(parts[0]), min_value=min_value)
        kind, *nums = parts
        vals = [float(v) for v in nums]
    except ValueError as e:
        raise ValueError(f"bad length spec {s!r}: {e}") from None
    want = 1 if kind == "fixed" else 2
    if len(vals) != want:
        raise ValueError(f"bad length spec {s!r}: {kind} takes {want} number(s)")
    return LengthDist(kind, *vals, min_value=min_value)
