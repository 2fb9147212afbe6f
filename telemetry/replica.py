"""What every pool replica sets up for telemetry, and how it reports one request's
pass through its engine (queue and compute, as spans and the queue-wait histogram)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Protocol

from opentelemetry.trace import Span

from telemetry import metrics, tracing
from telemetry.config import TelemetryConfig


class EngineRequestMetrics(Protocol):
    """The engine's per-request record (engine/request.py `RequestMetrics`)."""

    @property
    def arrival_time(self) -> float: ...

    @property
    def first_scheduled_time(self) -> float | None: ...

    @property
    def first_token_time(self) -> float | None: ...

    @property
    def finished_time(self) -> float: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def cached_tokens_by_source(self) -> dict[str, int]: ...

    @property
    def num_draft_tokens(self) -> int: ...

    @property
    def num_accepted_tokens(self) -> int: ...

    @property
    def queue_s(self) -> float: ...


class ReplicaTelemetry:
    """Owns one replica's tracer set-up, metric recorder and engine-stats reporter."""

    def __init__(self, config: Mapping | None, pool: str, replica: str, read_stats: Callable[[], Mapping]) -> None:
        self.pool = pool
        self.tracing = tracing.setup_tracing(TelemetryConfig.model_validate(config or {}), pool)
        self.metrics = metrics.Recorder(pool, replica)
        self.reporter = metrics.EngineStatsReporter(self.metrics, read_stats)

    def engine_request(self, span: Span, m: EngineRequestMetrics | None) -> None:
        """Queue wait into the histogram; on `span`: queue and compute child spans and
        the request's engine attributes (cached tokens by source, preemptions, and the
        speculative draft tokens scored and accepted)."""
        if m is None:
            return
        self.metrics.observe(metrics.QUEUE_WAIT, m.queue_s)
        if span is tracing.NO_SPAN:
            return
        scheduled = m.first_scheduled_time or m.finished_time
        tracing.record_span(f"{self.pool}.queue", span, m.arrival_time, scheduled)
        if m.first_scheduled_time is not None:
            tracing.record_span(f"{self.pool}.compute", span, m.first_scheduled_time, m.finished_time)
        attrs: dict[str, object] = {
            "duet.queue_ms": round(m.queue_s * 1e3, 3),
            "duet.preemptions": m.num_preemptions,
        }
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            attrs["duet.compute_to_first_token_ms"] = round((m.first_token_time - m.first_scheduled_time) * 1e3, 3)
        for source, n in m.cached_tokens_by_source.items():
            attrs[f"duet.cached_tokens.{source}"] = n
        if m.num_draft_tokens:  # speculative decoding
            attrs["duet.spec.draft_tokens"] = m.num_draft_tokens
            attrs["duet.spec.accepted_tokens"] = m.num_accepted_tokens
        tracing.set_attributes(span, attrs)

    async def traced(self, span: Span, batches: AsyncGenerator[list, None]) -> AsyncGenerator[list, None]:
        """A replica's stream of output batches, passed through: counts the tokens on
        `span`, reports the final output's engine metrics, and ends `span` however the
        stream ends (a client that leaves is `duet.cancelled`, not an error). Closing
        this closes `batches` at once (its cleanup aborts the request in the engine)."""
        started = time.monotonic()
        tokens = 0
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(batches) as it:
                async for outs in it:
                    tokens += sum(len(o.new_token_ids) for o in outs)
                    if outs[-1].finished:
                        self.engine_request(span, outs[-1].metrics)
                    yield outs
        except (asyncio.CancelledError, GeneratorExit):
            tracing.set_attributes(span, {"duet.cancelled": True})
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            tracing.set_attributes(span, {"gen_ai.usage.output_tokens": tokens,
                                          "duet.duration_ms": round((time.monotonic() - started) * 1e3, 3)})
            tracing.end_span(span, error)

    def close(self) -> None:
        self.reporter.close()
