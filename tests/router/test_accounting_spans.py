"""Spans leave the router only when an OTLP endpoint is configured: the wiring from a finished
request (``Accounting.finish``) to the tracer, and from settings to the app."""

from __future__ import annotations

from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.edge.app import create_app
from router.record.accounting import Accounting
from router.record.metrics import RouterMetrics
from router.settings import RouterSettings
from tests.telemetry.test_tracing import PD_WALK, _pd_trace


def test_a_finished_request_becomes_one_trace_in_order() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    accounting = Accounting(RouterMetrics(), None, None, tracer=provider.get_tracer("test"))
    accounting.finish(_pd_trace(), "chat", "ok", http_status=200)
    spans = sorted(exporter.get_finished_spans(), key=lambda s: (s.start_time, s.name != "tandem.request"))
    assert [s.name for s in spans] == PD_WALK
    assert len({s.context.trace_id for s in spans}) == 1
    assert spans[0].attributes["request_id"] == "chatcmpl-1"


def test_no_endpoint_no_tracer_and_an_endpoint_a_tracer(redis_unit_url: str) -> None:
    with TestClient(create_app(RouterSettings(redis_url=redis_unit_url, registry_refresh_s=60))) as c:
        assert c.app.state.accounting.tracer is None  # type: ignore[attr-defined]
    # Nothing listens at the endpoint: export fails in the provider's thread, never in a request.
    settings = RouterSettings(
        redis_url=redis_unit_url, registry_refresh_s=60, otlp_traces_endpoint="http://127.0.0.1:1/v1/traces"
    )
    with TestClient(create_app(settings)) as c:
        assert c.app.state.accounting.tracer is not None  # type: ignore[attr-defined]
        assert c.get("/health").status_code in (200, 503)
