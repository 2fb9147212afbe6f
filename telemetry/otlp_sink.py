"""A minimal OTLP/HTTP trace receiver: keeps the spans it is sent, in memory.

For the tracing tests and the tracing-overhead benchmark (and a quick look without
a collector: `python -m telemetry.otlp_sink --port 4318` prints one line per span).
It decodes `ExportTraceServiceRequest` protobufs (gzip or not) with the
`opentelemetry-proto` package; it is not a collector (no retries, no limits beyond
a bounded span count).
"""

from __future__ import annotations

import argparse
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_SPANS = 200_000


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str | None
    kind: int  # OTLP SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict = field(default_factory=dict)
    resource: dict = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def component(self) -> str | None:
        return self.resource.get("duet.component")


class OTLPSink:
    """Owns an HTTP server on 127.0.0.1:`port` (0: any free port) and the spans received."""

    def __init__(self, port: int = 0, on_span: Callable[[ReceivedSpan], None] | None = None) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._on_span = on_span
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                try:
                    sink._receive(body)
                except Exception as e:
                    self.send_error(400, str(e)[:200])
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The base URL to configure (`telemetry.otlp_endpoint`, OTEL_EXPORTER_OTLP_ENDPOINT)."""
        return f"http://127.0.0.1:{self.port}"

    def _receive(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        got = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None,
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status_code=s.status.code,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        resource=resource,
                    ))
        with self._lock:
            self.requests += 1
            room = MAX_SPANS - len(self.spans)
            self.spans.extend(got[:room])
        if self._on_span is not None:
            for span in got:
                self._on_span(span)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def find(self, **attributes) -> list[ReceivedSpan]:
        """Spans whose attributes include all of `attributes`."""
        with self._lock:
            return [s for s in self.spans if all(s.attributes.get(k) == v for k, v in attributes.items())]

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.1)
        return condition()

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def render_tree(spans: list[ReceivedSpan]) -> str:
    """One trace as an indented tree: offset from the root's start, duration, process."""
    if not spans:
        return ""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[ReceivedSpan]] = {}
    for s in spans:
        children.setdefault(s.parent_span_id if s.parent_span_id in ids else None, []).append(s)
    t0 = min(s.start_ns for s in spans)
    lines = [f"{'span':44s}{'start ms':>10s}{'dur ms':>10s}  process"]

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_ns):
            name = "  " * depth + s.name
            lines.append(f"{name:44s}{(s.start_ns - t0) / 1e6:10.1f}{s.duration_ms:10.1f}  {s.component or '?'}")
            walk(s.span_id, depth + 1)

    walk(None, 0)
    return "\n".join(lines)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print the spans an OTLP/HTTP exporter sends here.")
    p.add_argument("--port", type=int, default=4318)
    args = p.parse_args(argv)

    def show(s: ReceivedSpan) -> None:
        parent = s.parent_span_id or "-" * 16
        print(f"{s.trace_id[:16]} {parent} -> {s.span_id} {s.component or '?':10s} {s.name:40s} "
              f"{s.duration_ms:9.2f} ms", flush=True)

    sink = OTLPSink(args.port, on_span=show)
    print(f"OTLP/HTTP sink on {sink.endpoint} (POST /v1/traces); Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        sink.close()


if __name__ == "__main__":
    main()
