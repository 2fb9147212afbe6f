"""Benchmark metrics with the definitions of `vllm bench serve`, as pure functions
over recorded `RequestResult`s.

- TTFT: first non-empty streamed text minus send time.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with > 1 output token.
- ITL: every gap between consecutive streamed chunks, pooled across requests.
- E2EL: end of the stream minus send time.
- Output tokens: the generated text re-tokenized with the model's tokenizer.
- Throughputs: completed requests (and their tokens) over the benchmark duration.
- Goodput: requests meeting *every* given SLO (inclusive, `<=`) over the duration;
  a request with one output token has TPOT 0 for this test.

Failed and unfinished requests have no latencies, but they stay in `submitted`,
which is the denominator of `completion_ratio` and `goodput_ratio`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from loadgen.records import Outcome, RequestResult

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None means not part of the goodput test."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def describe(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
                if v is not None}


def parse_goodput(items: list[str] | None) -> SLO:
    """`["ttft:500", "tpot:50"]` -> SLO; the syntax of `--goodput` in vllm bench serve."""
    vals: dict[str, float] = {}
    for item in items or []:
        key, sep, ms = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: want KEY:MS with KEY in {SLO_KEYS}")
        if float(ms) < 0:
            raise ValueError(f"bad --goodput item {item!r}: negative milliseconds")
        vals[f"{key}_ms"] = float(ms)
    return SLO(**vals)


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies (seconds) of one completed request."""

    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None  # None when output_tokens <= 1 (excluded from TPOT stats)
    e2el: float
    itls: tuple[float, ...]

    @property
    def ttst(self) -> float | None:
        """Time to the second streamed chunk: TTFT plus the first gap, which in P/D
        includes the KV handoff that follows the first token."""
        return self.ttft + self.itls[0] if self.ttft is not None and self.itls else None

    def is_good(self, slo: SLO) -> bool:
        checks = (
            (slo.ttft_ms, self.ttft),
            (slo.tpot_ms, self.tpot if self.tpot is not None else 0.0),
            (slo.e2el_ms, self.e2el),
        )
        return all(ms is None or (v is not None and v <= ms / 1000.0) for ms, v in checks)


def request_metrics(r: RequestResult, count_tokens: Callable[[str], int]) -> RequestMetrics:
    """Metrics of one COMPLETED result."""
    if r.outcome is not Outcome.COMPLETED or r.e2el is None:
        raise ValueError("request_metrics needs a completed request")
    n_out = count_tokens(r.text)
    ttft = r.ttft
    tpot = (r.e2el - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else None
    itls = tuple(float(b - a) for a, b in zip(r.chunk_times, r.chunk_times[1:]))
    return RequestMetrics(r.prompt_tokens, n_out, ttft, tpot, r.e2el, itls)


def summarize_ms(values_s: list[float], percentiles: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    """mean/median/std and percentiles in ms (numpy's linear interpolation, as vLLM)."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in percentiles)]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=float) * 1000.0
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in percentiles})
    return out


@dataclass
class BenchMetrics:
    """The numbers of one sweep point (latencies in ms, rates per second)."""

    duration_s: float
    submitted: int
    completed: int
    failed: int
    unfinished: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    completion_ratio: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2el_ms: dict[str, float | None]
    ttst_ms: dict[str, float | None] = field(default_factory=dict)  # time to the second chunk
    slo: dict[str, float] = field(default_factory=dict)
    good: int | None = None
    goodput: float | None = None  # good requests / s
    goodput_ratio: float | None = None  # good / submitted
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    count_tokens: Callable[[str], int],
    slo: SLO | None = None,
    percentiles: tuple[int, ...] = PERCENTILES,
) -> tuple[BenchMetrics, list[RequestMetrics]]:
    """Aggregate the non-warm-up results of one sweep point over `duration_s`."""
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    measured = [r for r in results if not r.warmup]
    done = [r for r in measured if r.outcome is Outcome.COMPLETED]
    per = [request_metrics(r, count_tokens) for r in done]
    n = len(measured)
    errors: dict[str, int] = {}
    for r in measured:
        if r.outcome is not Outcome.COMPLETED:
            key = r.error.split(":")[0] if r.error else r.outcome.value
            errors[key] = errors.get(key, 0) + 1
    n_in = sum(m.prompt_tokens for m in per)
    n_out = sum(m.output_tokens for m in per)
    m = BenchMetrics(
        duration_s=duration_s,
        submitted=n,
        completed=len(done),
        failed=sum(r.outcome is Outcome.FAILED for r in measured),
        unfinished=sum(r.outcome is Outcome.UNFINISHED for r in measured),
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(done) / duration_s,
        output_throughput=n_out / duration_s,
        total_token_throughput=(n_in + n_out) / duration_s,
        completion_ratio=len(done) / n if n else 0.0,
        ttft_ms=summarize_ms([x.ttft for x in per if x.ttft is not None], percentiles),
        tpot_ms=summarize_ms([x.tpot for x in per if x.tpot is not None], percentiles),
        itl_ms=summarize_ms([g for x in per for g in x.itls], percentiles),
        e2el_ms=summarize_ms([x.e2el for x in per], percentiles),
        ttst_ms=summarize_ms([t for x in per if (t := x.ttst) is not None], percentiles),
        errors=errors,
    )
    if slo is not None and not slo.empty:
        good = sum(x.is_good(slo) for x in per)
        m.slo, m.good = slo.describe(), good
        m.goodput = good / duration_s
        m.goodput_ratio = good / n if n else 0.0
    return m, per
