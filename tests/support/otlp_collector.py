"""An OTLP/HTTP trace endpoint on loopback for tests: ``http.server`` in a thread that decodes every
POSTed ``ExportTraceServiceRequest`` (``opentelemetry.proto``) and keeps its spans, as a collector
would receive them from the router's exporter or vLLM's.

    with OtlpCollector() as collector:
        ... tracer_provider(collector.url) ...
        spans = collector.wait_for(lambda spans: any(s.name == "tandem.request" for s in spans))
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    """The exporting process's ``service.name`` resource attribute."""
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None


def _int(raw: bytes) -> int | None:
    return int.from_bytes(raw, "big") if raw else None


class OtlpCollector:
    """Keeps every span POSTed to ``url`` (``/v1/traces``); ``wait_for`` blocks until a condition holds."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.posts: list[str] = []
        """Path and content type of every POST (``/v1/traces application/x-protobuf``)."""
        self._changed = threading.Condition()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                collector._keep(f"{self.path} {self.headers.get('Content-Type')}", raw)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)

    def _keep(self, post: str, raw: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(raw)
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                got += [self._span(attrs.get("service.name", ""), s) for s in ss.spans]
        with self._changed:
            self.posts.append(post)
            self.spans += got
            self._changed.notify_all()

    @staticmethod
    def _span(service: str, s: Span) -> ReceivedSpan:
        return ReceivedSpan(service, s.name, _int(s.trace_id) or 0, _int(s.span_id) or 0, _int(s.parent_span_id))

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans received so far, once ``done(spans)`` holds; AssertionError after ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: done(self.spans), timeout=timeout_s):
                raise AssertionError(f"the collector did not get the spans in {timeout_s} s: {self.spans}")
            return list(self.spans)

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
