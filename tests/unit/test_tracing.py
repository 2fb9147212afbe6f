"""Tracing set-up, context propagation and export, in-process (no Ray)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from telemetry import tracing
from telemetry.config import TelemetryConfig
from telemetry.otlp_sink import OTLPSink

pytestmark = pytest.mark.unit


@pytest.fixture
def sink():
    s = OTLPSink()
    yield s
    s.close()


@pytest.fixture
def traced(sink):
    assert tracing.setup_tracing(TelemetryConfig(tracing=True, otlp_endpoint=sink.endpoint, export_delay_ms=50), "t")
    yield sink
    tracing.shutdown()


def test_off_by_default_creates_no_provider_and_no_exporter():
    code = (
        "import sys\n"
        "from telemetry import tracing\n"
        "assert tracing.setup_tracing({}, 'gateway') is False\n"
        "s = tracing.start_span('x')\n"
        "assert s is tracing.NO_SPAN and tracing.carrier(s) is None\n"
        "assert tracing.context_from_headers({'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}) is None\n"
        "assert not any(m.startswith('opentelemetry.exporter') or m.startswith('opentelemetry.sdk')"
        " for m in sys.modules)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_otel_variables_turn_tracing_on_and_config_wins_where_set():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_SERVICE_NAME": "svc"}
    got = TelemetryConfig().resolved(env)
    assert (got.tracing, got.otlp_endpoint, got.otlp_protocol, got.sample_ratio, got.service_name) == (
        True, "http://collector:4318", "grpc", 0.25, "svc")
    mine = TelemetryConfig(otlp_endpoint="http://mine:4318", sample_ratio=0.5).resolved(env)
    assert (mine.tracing, mine.otlp_endpoint, mine.sample_ratio) == (False, "http://mine:4318", 0.5)
    assert TelemetryConfig(tracing=True).resolved({"OTEL_SDK_DISABLED": "true"}).tracing is False
    assert TelemetryConfig().resolved({}).tracing is False


def test_a_carrier_joins_spans_of_two_processes_under_one_trace(traced):
    root = tracing.start_span("chat m", kind=tracing.SpanKind.SERVER, attributes={"gen_ai.request.max_tokens": 8})
    sent = tracing.carrier(root)
    assert sent is not None and set(sent) == {"traceparent"}
    # the other process: only the carrier travels
    child = tracing.start_span("prefill", sent, tracing.SpanKind.SERVER, {"duet.kv_blocks": 3, "skip": None})
    tracing.end_span(child)
    tracing.end_span(root, RuntimeError("boom"))
    tracing.flush()
    assert traced.wait_for(lambda: len(traced.spans) == 2, 10)
    by_name = {s.name: s for s in traced.spans}
    parent, kid = by_name["chat m"], by_name["prefill"]
    assert kid.trace_id == parent.trace_id and kid.parent_span_id == parent.span_id
    assert kid.attributes == {"duet.kv_blocks": 3}
    assert parent.status_code == 2 and parent.attributes["error.type"] == "RuntimeError"
    assert parent.resource["duet.component"] == "t" and parent.resource["service.name"] == "duet"


def test_a_client_traceparent_is_continued(traced):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    ctx = tracing.context_from_headers({"traceparent": f"00-{trace_id}-{parent_id}-01"})
    tracing.end_span(tracing.start_span("chat m", ctx, tracing.SpanKind.SERVER))
    assert tracing.context_from_headers({"traceparent": "garbage"}) is None
    tracing.flush()
    assert traced.wait_for(lambda: len(traced.spans) == 1, 10)
    (span,) = traced.spans
    assert (span.trace_id, span.parent_span_id) == (trace_id, parent_id)


def test_a_span_measured_before_keeps_its_times(traced):
    import time

    root = tracing.start_span("decode")
    t0 = time.monotonic() - 0.5
    tracing.record_span("decode.queue", root, t0, t0 + 0.2)
    tracing.end_span(root)
    tracing.flush()
    assert traced.wait_for(lambda: len(traced.spans) == 2, 10)
    queue = next(s for s in traced.spans if s.name == "decode.queue")
    assert queue.duration_ms == pytest.approx(200, abs=1)


def test_grpc_export_reaches_an_otlp_grpc_receiver():
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got: list[str] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
            got.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        cfg = TelemetryConfig(tracing=True, otlp_protocol="grpc", otlp_endpoint=f"http://127.0.0.1:{port}")
        assert tracing.setup_tracing(cfg, "t")
        tracing.end_span(tracing.start_span("over grpc"))
        tracing.flush()
        assert got == ["over grpc"]
    finally:
        tracing.shutdown()
        server.stop(None)


def test_sampling_keeps_a_ratio_of_new_traces_and_every_sampled_parent(sink):
    assert tracing.setup_tracing(TelemetryConfig(tracing=True, otlp_endpoint=sink.endpoint, sample_ratio=0.0), "t")
    try:
        dropped = tracing.start_span("new trace")
        assert not dropped.is_recording()
        # ...but its context still travels, so the other processes drop it too
        sent = tracing.carrier(dropped)
        assert sent is not None and sent["traceparent"].endswith("-00")
        assert not tracing.start_span("child", sent).is_recording()
        tracing.end_span(dropped)
        ctx = tracing.context_from_headers({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
        tracing.end_span(tracing.start_span("client sampled it", ctx))
        tracing.flush()
        assert sink.wait_for(lambda: len(sink.spans) == 1, 10)
        assert [s.name for s in sink.spans] == ["client sampled it"]
    finally:
        tracing.shutdown()


def test_console_exporter_prints_spans():
    code = (
        "from telemetry import tracing\n"
        "tracing.setup_tracing({'tracing': True, 'console': True}, 'gateway')\n"
        "tracing.end_span(tracing.start_span('printed span'))\n"
        "tracing.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert '"name": "printed span"' in out.stdout
