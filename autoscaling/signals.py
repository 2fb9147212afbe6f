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
# Ingress (the gateway inside each replica that decodes). Every replica reports its own
# requests; `merge_ingress_reports` makes the cluster's view of them.
ARRIVAL_PROMPT_TOKENS_PER_S = "arrival_prompt_tokens_per_s"
ARRIVALS_PER_S = "arrivals_per_s"
FINISHED = "finished"  # requests finished in the window (how much the latencies below are worth)
TTFT_MS = "ttft_ms"  # end to end, queue included, at the SLO quantile
TPOT_MS = "tpot_ms"
GOODPUT = "goodput"  # fraction of the window's finished requests that met the SLO
GOOD = "good"  # finished requests in the window that met the SLO (GOODPUT's numerator)
IN_FLIGHT = "in_flight"
# The window's TTFT and TPOT samples as histogram counts, one number per bucket
# (`ttft_ms_bucket_<i>`): counts add up across replicas, so the merged histogram's
# quantile is the quantile of the union of every replica's samples, to within one
# bucket (LatencyBuckets.RATIO), not an average of per-replica quantiles.
TTFT_BUCKET_PREFIX = f"{TTFT_MS}_bucket_"
TPOT_BUCKET_PREFIX = f"{TPOT_MS}_bucket_"

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


class LatencyBuckets:
    """Fixed log-spaced bucket edges shared by every replica and the policy: bucket `i`
    holds samples in [LOW_MS * RATIO**(i-1), LOW_MS * RATIO**i) ms, bucket 0 everything
    below LOW_MS, the last everything above. A quantile read from merged counts is the
    bucket's geometric middle, within a factor sqrt(RATIO) (~5%) of the exact
    nearest-rank value.

    The keys are the same in every report: Serve averages each key over its look-back
    period, which only a fixed key set keeps meaningful (counts average linearly)."""

    LOW_MS = 1.0
    HIGH_MS = 600_000.0  # ten minutes: the gateway's default request deadline
    RATIO = 1.1
    COUNT = math.ceil(math.log(HIGH_MS / LOW_MS) / math.log(RATIO)) + 2

    @classmethod
    def index(cls, ms: float) -> int:
        if ms < cls.LOW_MS:
            return 0
        return min(cls.COUNT - 1, 1 + math.floor(math.log(ms / cls.LOW_MS) / math.log(cls.RATIO)))

    @classmethod
    def middle_ms(cls, i: int) -> float:
        if i <= 0:
            return cls.LOW_MS
        return cls.HIGH_MS if i >= cls.COUNT - 1 else cls.LOW_MS * cls.RATIO ** (i - 0.5)

    @classmethod
    def counts(cls, samples_s: list[float], prefix: str) -> dict[str, float]:
        counts = [0.0] * cls.COUNT
        for v in samples_s:
            counts[cls.index(v * 1e3)] += 1.0
        return {f"{prefix}{i}": c for i, c in enumerate(counts)}

    @classmethod
    def quantile_ms(cls, counts: list[float], q: float) -> float | None:
        """The nearest-rank `q` quantile of the samples `counts` hold; None if empty."""
        total = sum(counts)
        if total <= 0:
            return None
        rank = max(1.0, math.ceil(q * total - 1e-9))
        seen = 0.0
        for i, c in enumerate(counts):
            seen += c
            if seen >= rank - 1e-9:
                return cls.middle_ms(i)
        return cls.middle_ms(cls.COUNT - 1)


class GatewaySignals:
    """One ingress replica's side: arrivals, and each finished request's TTFT and TPOT
    against the SLO (`ttft_ms`, `tpot_ms` bounds; None: not judged). Its report holds
    the window's latencies as bucket counts too, for `merge_ingress_reports`."""

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
            GOOD: self.good.total(),
            TTFT_MS: _ms(self.ttft.quantile(self.quantile)),
            TPOT_MS: _ms(self.tpot.quantile(self.quantile)),
            GOODPUT: -1.0 if goodput is None else goodput,
            IN_FLIGHT: float(self.in_flight),
            **LatencyBuckets.counts(self.ttft.values(), TTFT_BUCKET_PREFIX),
            **LatencyBuckets.counts(self.tpot.values(), TPOT_BUCKET_PREFIX),
        }


# Ingress signals that add up across replicas.
_SUMMED = (ARRIVALS_PER_S, ARRIVAL_PROMPT_TOKENS_PER_S, FINISHED, GOOD, IN_FLIGHT)


def merge_ingress_reports(reports: list[Mapping[str, float]], quantile: float) -> dict[str, float]:
    """The cluster's ingress view from every ingress replica's `GatewaySignals.report()`:
    rates, counts and requests in flight add up; goodput is the union's (good over
    finished); the TTFT and TPOT tails are the `quantile` of the union of the
    replicas' samples, read from their summed bucket counts. A report without buckets
    (a replica of an older version) adds its counts but no latency samples."""
    out = {k: sum(r.get(k, 0.0) for r in reports) for k in _SUMMED}
    finished, good = out[FINISHED], out[GOOD]
    out[GOODPUT] = good / finished if finished > 0 else -1.0
    for key, prefix in ((TTFT_MS, TTFT_BUCKET_PREFIX), (TPOT_MS, TPOT_BUCKET_PREFIX)):
        counts = [sum(max(0.0, r.get(f"{prefix}{i}", 0.0)) for r in reports) for i in range(LatencyBuckets.COUNT)]
        out[key] = _ms(None if (q := LatencyBuckets.quantile_ms(counts, quantile)) is None else q / 1e3)
    return out


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
