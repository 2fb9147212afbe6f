"""What replicas and the gateway report for autoscaling, and how they compute it.

Each pool replica returns a flat `{name: number}` from its deployment's
`record_autoscaling_stats()` (Ray Serve carries it to the controller, where the
policy reads it); the names below are that contract. Latencies and rates are taken
over a sliding window at the replica, so the controller never sees a single
request, and queue wait is always inside TTFT.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

# Prefill replica.
QUEUED_PROMPT_TOKENS = "queued_prompt_tokens"  # prompt tokens not yet computed (waiting + partly done)
WAITING = "waiting"  # requests not yet scheduled
RUNNING = "running"  # requests in the running batch
PROMPT_TOKENS_PER_S = "prompt_tokens_per_s"  # prompt tokens finished per second (the window)
CAPACITY_TOKENS_PER_S = "capacity_tokens_per_s"  # prompt tokens per busy second (0: not measured)
QUEUE_WAIT_MS = "queue_wait_ms"  # queue wait at the SLO quantile
REPLICA_TTFT_MS = "replica_ttft_ms"  # arrival at the replica to first token, at the SLO quantile
# Decode replica.
KV_BLOCKS_USED = "kv_blocks_used"
KV_BLOCKS_TOTAL = "kv_blocks_total"
WAITING_IMPORTS = "waiting_imports"  # KV imports under way (requests about to join)
REPLICA_TPOT_MS = "replica_tpot_ms"  # per output token, at the SLO quantile
MEAN_TPOT_MS = "mean_tpot_ms"  # per output token, the mean (what a step-time model predicts)
MEAN_BATCH = "mean_batch"  # sequences decoding at once, on average over the window (what that TPOT was measured at)
LOCAL_PROMPT_TOKENS_PER_S = "local_prompt_tokens_per_s"  # prompt tokens computed here per second (prefill on decode)
# Gateway.
ARRIVAL_PROMPT_TOKENS_PER_S = "arrival_prompt_tokens_per_s"
ARRIVALS_PER_S = "arrivals_per_s"
FINISHED = "finished"  # requests finished in the window (how much the latencies below are worth)
TTFT_MS = "ttft_ms"  # end to end, queue included, at the SLO quantile
TPOT_MS = "tpot_ms"
GOODPUT = "goodput"  # fraction of the window's finished requests that met the SLO
IN_FLIGHT = "in_flight"

# Latency quantiles need samples: a longer window. Rates must follow a burst: a short one.
WINDOW_S = 20.0
RATE_WINDOW_S = 5.0


class Window:
    """Timestamped samples kept for `span_s`: quantiles, sums and rates of what is left.
    The sum is kept as samples come and go: a request's end costs O(1), not O(window)."""

    def __init__(self, span_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.span_s = span_s
        self.clock = clock
        self.started = clock()
        self._samples: deque[tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, value: float, at: float | None = None) -> None:
        self._samples.append((self.clock() if at is None else at, value))
        self._sum += value

    def _prune(self) -> float:
        now = self.clock()
        while self._samples and self._samples[0][0] < now - self.span_s:
            self._sum -= self._samples.popleft()[1]
        if not self._samples:
            self._sum = 0.0  # no float drift survives an empty window
        return now

    def values(self) -> list[float]:
        self._prune()
        return [v for _, v in self._samples]

    def count(self) -> int:
        self._prune()
        return len(self._samples)

    def total(self) -> float:
        self._prune()
        return self._sum

    def mean(self) -> float | None:
        n = self.count()
        return self._sum / n if n else None

    def quantile(self, q: float) -> float | None:
        """The `q` quantile (nearest rank), None without samples."""
        vals = sorted(self.values())
        if not vals:
            return None
        return vals[min(len(vals) - 1, max(0, math.ceil(q * len(vals)) - 1))]

    def rate(self) -> float:
        """Sum per second over the window (over the time since start while younger)."""
        now = self._prune()
        span = min(self.span_s, max(now - self.started, 1e-9))
        return self._sum / span


class BusyTime:
    """The seconds of the window during which at least one interval was open: the
    union of requests' compute intervals, so overlapping requests count once."""

    def __init__(self, span_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.span_s = span_s
        self.clock = clock
        self._intervals: deque[tuple[float, float]] = deque()

    def add(self, start: float, end: float) -> None:
        self._intervals.append((start, end))

    def seconds(self) -> float:
        now = self.clock()
        lo = now - self.span_s
        while self._intervals and self._intervals[0][1] < lo:
            self._intervals.popleft()
        busy = 0.0
        merged: tuple[float, float] | None = None  # the union of overlapping intervals so far
        for s, e in sorted((max(s, lo), e) for s, e in self._intervals if e > lo):
            if merged is None or s > merged[1]:
                if merged is not None:
                    busy += merged[1] - merged[0]
                merged = (s, e)
            else:
                merged = (merged[0], max(merged[1], e))
        if merged is not None:
            busy += merged[1] - merged[0]
        return busy


class EngineLoad(Protocol):
    """A replica engine's queues and block pool, as the signals read them: a pool
    server passes its engine's `EngineStats` (engine/stats.py has these fields; this
    room imports no other, so the type is structural)."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def queued_prefill_tokens(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int: ...

    @property
    def kv_blocks_free(self) -> int: ...


@dataclass(frozen=True)
class LoadSnapshot:
    """An `EngineLoad` for callers without an engine (the autoscaling simulator, tests)."""

    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0


class PrefillSignals:
    """A prefill replica's side: fed each finished request's engine times (monotonic
    seconds), reports queue, rate, capacity and latency."""

    def __init__(self, quantile: float = 0.9, span_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.quantile = quantile
        self.tokens = Window(min(span_s, RATE_WINDOW_S), clock)
        self.queue_wait = Window(span_s, clock)
        self.ttft = Window(span_s, clock)
        self.busy = BusyTime(span_s, clock)
        self.computed = Window(span_s, clock)  # prompt tokens computed (cache hits excluded)

    def request(self, arrival: float, first_scheduled: float | None, first_token: float | None,
                finished: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.tokens.add(prompt_tokens, finished)
        self.queue_wait.add((first_scheduled or finished) - arrival, finished)
        if first_token is not None:
            self.ttft.add(first_token - arrival, finished)
        if first_scheduled is not None:
            self.busy.add(first_scheduled, finished)
            self.computed.add(max(0, prompt_tokens - cached_tokens), finished)

    def report(self, load: EngineLoad) -> dict[str, float]:
        busy = self.busy.seconds()
        computed = self.computed.total()
        # Under a second of work says little about speed: report "not measured".
        capacity = computed / busy if busy >= 1.0 and computed > 0 else 0.0
        return {
            QUEUED_PROMPT_TOKENS: float(load.queued_prefill_tokens),
            WAITING: float(load.num_waiting),
            RUNNING: float(load.num_running),
            PROMPT_TOKENS_PER_S: self.tokens.rate(),
            CAPACITY_TOKENS_PER_S: capacity,
            QUEUE_WAIT_MS: _ms(self.queue_wait.quantile(self.quantile)),
            REPLICA_TTFT_MS: _ms(self.ttft.quantile(self.quantile)),
        }


class DecodeSignals:
    """A decode replica's side: fed each finished request's decode time and tokens."""

    def __init__(self, quantile: float = 0.9, span_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.quantile = quantile
        self.span_s = span_s
        self.clock = clock
        self.tpot = Window(span_s, clock)
        self.decoding = Window(span_s, clock)  # seconds each finished request spent decoding
        self.prefilled = Window(min(span_s, RATE_WINDOW_S), clock)  # prompt tokens computed here
        self.started = clock()

    def request(self, first_scheduled: float | None, finished: float, output_tokens: int) -> None:
        if first_scheduled is not None and output_tokens > 1:
            self.tpot.add((finished - first_scheduled) / (output_tokens - 1), finished)
            self.decoding.add(finished - first_scheduled, finished)

    def prefilled_here(self, computed_prompt_tokens: int, at: float) -> None:
        """A prompt this replica prefilled itself (the router's `disaggregation` kept it
        local): its uncached tokens, computed in this replica's steps beside the batch."""
        self.prefilled.add(computed_prompt_tokens, at)

    def mean_batch(self) -> float | None:
        """Little's law over the window: sequence-seconds of decoding per second."""
        if not self.decoding.count():
            return None
        return self.decoding.total() / min(self.span_s, max(self.clock() - self.started, 1e-9))

    def report(self, load: EngineLoad, waiting_imports: int) -> dict[str, float]:
        total = float(load.kv_blocks_total)
        return {
            RUNNING: float(load.num_running),
            WAITING: float(load.num_waiting),
            KV_BLOCKS_USED: total - float(load.kv_blocks_free),
            KV_BLOCKS_TOTAL: total,
            WAITING_IMPORTS: float(waiting_imports),
            REPLICA_TPOT_MS: _ms(self.tpot.quantile(self.quantile)),
            MEAN_TPOT_MS: _ms(self.tpot.mean()),
            MEAN_BATCH: -1.0 if (b := self.mean_batch()) is None else b,
            LOCAL_PROMPT_TOKENS_PER_S: self.prefilled.rate(),
        }


class GatewaySignals:
    """The gateway's side: arrivals, and each finished request's TTFT and TPOT
    against the SLO (`ttft_ms`, `tpot_ms` bounds; None: not judged)."""

    def __init__(self, ttft_ms: float | None, tpot_ms: float | None, quantile: float = 0.9,
                 span_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.slo = (ttft_ms, tpot_ms)
        self.quantile = quantile
        self.arrivals = Window(min(span_s, RATE_WINDOW_S), clock)
        self.prompt_tokens = Window(min(span_s, RATE_WINDOW_S), clock)
        self.ttft = Window(span_s, clock)
        self.tpot = Window(span_s, clock)
        self.good = Window(span_s, clock)
        self.in_flight = 0

    def arrived(self, prompt_tokens: int) -> None:
        self.arrivals.add(1.0)
        self.prompt_tokens.add(float(prompt_tokens))

    def finished(self, ttft_s: float | None, tpot_s: float | None, ok: bool) -> None:
        """One request's end. A failed request (`ok` False) is never good."""
        if ttft_s is not None:
            self.ttft.add(ttft_s)
        if tpot_s is not None:
            self.tpot.add(tpot_s)
        ttft_bound, tpot_bound = self.slo
        good = ok and ttft_s is not None
        if good and ttft_s is not None and ttft_bound is not None:
            good = ttft_s * 1e3 <= ttft_bound
        if good and tpot_bound is not None and tpot_s is not None:
            good = tpot_s * 1e3 <= tpot_bound
        self.good.add(1.0 if good else 0.0)

    def goodput(self) -> float | None:
        return self.good.mean()

    def report(self) -> dict[str, float]:
        goodput = self.goodput()
        return {
            ARRIVALS_PER_S: self.arrivals.rate(),
            ARRIVAL_PROMPT_TOKENS_PER_S: self.prompt_tokens.rate(),
            FINISHED: float(self.good.count()),
            TTFT_MS: _ms(self.ttft.quantile(self.quantile)),
            TPOT_MS: _ms(self.tpot.quantile(self.quantile)),
            GOODPUT: -1.0 if goodput is None else goodput,
            IN_FLIGHT: float(self.in_flight),
        }


def _ms(seconds: float | None) -> float:
    """Serve's custom metrics are numbers only: -1 stands for "no sample"."""
    return -1.0 if seconds is None else seconds * 1e3


@dataclass(frozen=True)
class ReplicaReport:
    """One running replica as the policy sees it: its age and its last report."""

    replica_id: str
    age_s: float
    values: Mapping[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float | None:
        """A value, None when missing or "no sample" (negative)."""
        v = self.values.get(name)
        return None if v is None or v < 0 or math.isnan(v) else float(v)
