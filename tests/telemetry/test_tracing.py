"""A P/D request's record becomes one trace whose spans cover router, prefill, transfer and decode in
order (OpenTelemetry SDK, in-memory exporter); no endpoint, no provider."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from router.orchestrator import RequestTrace
from router.policies import ReasonCode
from router.records import request_record
from telemetry.tracing import record_spans, tracer_provider


def _spans(record: dict) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    record_spans(record, provider.get_tracer("test"))
    return sorted(exporter.get_finished_spans(), key=lambda s: (s.start_time, s.name != "tandem.request"))


def _pd_trace() -> RequestTrace:
    t = 1_800_000_000.0
    tr = RequestTrace(request_id="chatcmpl-1", kind="chat", model="m", arrival=t)
    tr.mode, tr.prefill_node, tr.decode_node, tr.decode_role = "disaggregated", "p0", "d0", "decode"
    tr.routed, tr.prefill_start, tr.prefill_end = t + 0.002, t + 0.003, t + 0.200
    tr.transfer = {"bytes": 67_000_000, "seconds": 0.03, "transport": "shm", "start": t + 0.205, "end": t + 0.235}
    tr.first_token, tr.finish = t + 0.260, t + 1.0
    tr.reason_code, tr.decode_reason_code = ReasonCode.BEST_PREFIX, ReasonCode.LEAST_BUSY
    tr.prompt_tokens, tr.engine_cached_tokens = 3000, 1024
    return tr


def test_a_pd_request_is_one_trace_router_prefill_transfer_decode_in_order() -> None:
    spans = _spans(request_record(_pd_trace(), endpoint="chat", http_status=200))
    names = [s.name for s in spans]
    assert names == [
        "tandem.request",
        "tandem.route",
        "tandem.prefill",
        "tandem.decode",
        "tandem.kv_transfer",
        "tandem.stream",
    ]
    assert len({s.context.trace_id for s in spans}) == 1
    root, route, prefill, decode, xfer, stream = spans
    assert all(s.parent.span_id == root.context.span_id for s in (route, prefill, decode))
    assert xfer.parent.span_id == stream.parent.span_id == decode.context.span_id
    # the walk in order: router, prefill, transfer, decode's first token and stream
    for a, b in ((route, prefill), (prefill, xfer), (xfer, stream)):
        assert a.end_time <= b.start_time, (a.name, b.name)
    assert prefill.end_time <= decode.start_time <= xfer.start_time
    assert root.start_time == route.start_time and decode.end_time == stream.end_time == root.end_time
    assert prefill.end_time - prefill.start_time == 197_000_000
    assert root.attributes["routing_reason_code"] == "best_prefix" and xfer.attributes["transport"] == "shm"


def test_a_colocated_request_has_no_prefill_or_transfer_span() -> None:
    tr = _pd_trace()
    tr.mode, tr.prefill_start, tr.prefill_end, tr.transfer = "colocated", None, None, None
    names = [s.name for s in _spans(request_record(tr, endpoint="chat", http_status=200))]
    assert names == ["tandem.request", "tandem.route", "tandem.decode", "tandem.stream"]


def test_no_endpoint_no_provider() -> None:
    assert tracer_provider(None) is None and tracer_provider("") is None
    provider = tracer_provider("http://127.0.0.1:4318/v1/traces")
    assert provider is not None
    provider.shutdown()
