"""OpenTelemetry tracing for one process: set-up, spans, and the W3C context that
joins the processes of one request.

Every process of the cluster (gateway, prefill and decode replicas) calls
`setup_tracing` once with the same resolved `TelemetryConfig`. With tracing off no
provider or exporter is created and every helper here returns at its first line:
spans are the API's shared non-recording span, carriers are None.

Context crosses processes explicitly, as a W3C `traceparent` carrier (a small
dict) inside the typed messages and call arguments (`prefill(..., trace=...)`,
`DecodeRequest.trace`). Nothing relies on the current-context variable across an
`await` or a Serve call: spans are started with an explicit parent and ended
explicitly, so async generators and Serve's router threads cannot detach the
wrong context.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from telemetry.config import TelemetryConfig

log = logging.getLogger(__name__)

__all__ = ["Carrier", "Context", "NO_SPAN", "Span", "SpanKind", "carrier", "context_from_headers", "end_span",
           "enabled", "flush", "record_span", "set_attributes", "setup_tracing", "shutdown", "start_span"]

Carrier = dict[str, str]
NO_SPAN: Span = trace.INVALID_SPAN

_propagator = TraceContextTextMapPropagator()
_lock = threading.Lock()
_tracer: trace.Tracer | None = None  # None: tracing is off in this process
_provider = None


def setup_tracing(config: TelemetryConfig | Mapping | None, component: str) -> bool:
    """Install this process's tracer provider (once; later calls keep the first).
    `component` names the process (`gateway`, `prefill`, ...) on every span it
    exports. Returns whether tracing is on."""
    global _tracer, _provider
    cfg = config if isinstance(config, TelemetryConfig) else TelemetryConfig.model_validate(config or {})
    if not cfg.tracing:
        return _tracer is not None
    with _lock:
        if _tracer is not None:
            return True
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create({"service.name": cfg.service_name, "duet.component": component})
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        if cfg.otlp_endpoint is not None or not cfg.console:
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(cfg),
                                                           schedule_delay_millis=cfg.export_delay_ms))
        if cfg.console:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        _provider = provider
        _tracer = provider.get_tracer("duet")
        log.info("tracing on (%s, %s, sample ratio %s)", component, cfg.otlp_endpoint or "console", cfg.sample_ratio)
        return True


def _otlp_exporter(cfg: TelemetryConfig):
    headers = cfg.otlp_headers or None
    if cfg.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=cfg.otlp_endpoint, headers=headers, insecure=_insecure(cfg.otlp_endpoint))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = cfg.otlp_endpoint
    if endpoint is not None and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint, headers=headers)


def _insecure(endpoint: str | None) -> bool | None:
    return None if endpoint is None else endpoint.startswith("http://")


def enabled() -> bool:
    return _tracer is not None


def flush(timeout_s: float = 5.0) -> None:
    """Export every finished span now (tests, shutdown)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Flush and stop this process's exporters; tracing is off afterwards."""
    global _tracer, _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _tracer, _provider = None, None


# ------------------------------------------------------------------ spans
def start_span(
    name: str,
    parent: Carrier | Context | Span | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    start_time: float | None = None,
) -> Span:
    """A started span, child of `parent` (a carrier from another process, a context,
    or a span of this one); NO_SPAN when tracing is off. `start_time` is a
    `time.monotonic()` reading, for spans of something measured before. End it
    with `end_span`."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_span(
        name,
        context=_context(parent),
        kind=kind,
        attributes=_clean(attributes),
        start_time=None if start_time is None else monotonic_ns(start_time),
    )


def end_span(span: Span, error: BaseException | str | None = None, end_time: float | None = None) -> None:
    """End `span`, marking it failed when `error` is given (`end_time`: monotonic)."""
    if span is NO_SPAN or not span.is_recording():
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)[:500] if str(error) else type(error).__name__))
        if isinstance(error, BaseException):
            span.set_attribute("error.type", type(error).__name__)
            span.record_exception(error)
        else:
            span.set_attribute("error.type", str(error))
    span.end(end_time=None if end_time is None else monotonic_ns(end_time))


def record_span(
    name: str,
    parent: Carrier | Context | Span | None,
    start: float,
    end: float,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A finished span for an interval measured elsewhere (monotonic seconds)."""
    if _tracer is None:
        return
    end_span(start_span(name, parent, attributes=attributes, start_time=start), end_time=end)


def set_attributes(span: Span, attributes: Mapping[str, Any]) -> None:
    if span is not NO_SPAN and span.is_recording():
        span.set_attributes(_clean(attributes) or {})


def carrier(span: Span | None) -> Carrier | None:
    """The W3C `traceparent` of `span`, to send with a message; None when there is
    nothing to continue (tracing off, or the span was not sampled)."""
    if span is None or span is NO_SPAN or not span.get_span_context().is_valid:
        return None
    out: Carrier = {}
    _propagator.inject(out, context=trace.set_span_in_context(span))
    return out or None


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """A client's `traceparent` / `tracestate`, if it sent a valid one."""
    if _tracer is None or "traceparent" not in headers:
        return None
    ctx = _propagator.extract({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def _context(parent: Carrier | Context | Span | None) -> Context | None:
    if parent is None:
        return Context()  # a root: never inherit whatever the current context holds
    if isinstance(parent, Span):
        return trace.set_span_in_context(parent)
    if isinstance(parent, Context):
        return parent
    return _propagator.extract(parent)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """OTel takes str, bool, int, float and sequences of them; None is dropped."""
    if not attributes:
        return None
    out = {}
    for k, v in attributes.items():
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            v = [x if isinstance(x, (str, bool, int, float)) else str(x) for x in v]
        elif not isinstance(v, (str, bool, int, float)):
            v = str(v)
        out[k] = v
    return out


def monotonic_ns(t: float) -> int:
    """Unix-epoch nanoseconds of a `time.monotonic()` reading in this process."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)
