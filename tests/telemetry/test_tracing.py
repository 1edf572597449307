"""A P/D request's record becomes one trace whose spans cover router, prefill, transfer and decode in
order (OpenTelemetry SDK, in-memory exporter); no endpoint, no provider. The prefill and decode spans
take the ids their legs' ``traceparent`` named, so vLLM's spans nest under them, and the spans reach an
OTLP/HTTP endpoint (a local ``http.server``, decoded with ``opentelemetry.proto``)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from router.planning.orchestrator import RequestTrace
from router.policies import ReasonCode
from router.record.records import request_record
from telemetry.tracing import PresetIds, SpanIds, record_spans, tracer_provider
from tests.support.otlp_collector import OtlpCollector


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


PD_WALK = ["tandem.request", "tandem.route", "tandem.prefill", "tandem.decode", "tandem.kv_transfer", "tandem.stream"]
"""A P/D request's spans, in the order they start."""


def test_a_pd_request_is_one_trace_router_prefill_transfer_decode_in_order() -> None:
    spans = _spans(request_record(_pd_trace(), endpoint="chat", http_status=200))
    names = [s.name for s in spans]
    assert names == PD_WALK
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
    assert provider is not None and isinstance(provider.id_generator, PresetIds)
    provider.shutdown()


IDS = SpanIds(
    trace_id=0x0AF7651916CD43DD8448EB211C80319C, prefill_span_id=0xB7AD6B7169203331, decode_span_id=0x1F2E3D4C5B6A7988
)


def _preset_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=PresetIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_the_ids_the_legs_were_sent_are_the_ids_of_the_router_spans() -> None:
    provider, exporter = _preset_provider()
    record_spans(request_record(_pd_trace(), endpoint="chat", http_status=200), provider.get_tracer("t"), IDS)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {s.context.trace_id for s in spans.values()} == {IDS.trace_id}
    assert spans["tandem.prefill"].context.span_id == IDS.prefill_span_id
    assert spans["tandem.decode"].context.span_id == IDS.decode_span_id
    others = [s.context.span_id for n, s in spans.items() if n not in ("tandem.prefill", "tandem.decode")]
    assert len(set(others)) == 4 and not {IDS.prefill_span_id, IDS.decode_span_id} & set(others)
    assert spans["tandem.kv_transfer"].parent.span_id == IDS.decode_span_id

    # vLLM's llm_request span, parented on the traceparent a leg carried, nests under that leg's span.
    for leg, span_id in (("tandem.prefill", IDS.prefill_span_id), ("tandem.decode", IDS.decode_span_id)):
        header = {"traceparent": f"00-{IDS.trace_id:032x}-{span_id:016x}-01"}
        engine = TracerProvider()
        engine_spans = InMemorySpanExporter()
        engine.add_span_processor(SimpleSpanProcessor(engine_spans))
        engine.get_tracer("vllm").start_span(
            "llm_request", context=TraceContextTextMapPropagator().extract(header)
        ).end()
        [llm] = engine_spans.get_finished_spans()
        assert llm.context.trace_id == spans[leg].context.trace_id and llm.parent.span_id == spans[leg].context.span_id

    # A preset is used once: the next trace's ids are random again.
    exporter.clear()
    record_spans(request_record(_pd_trace(), endpoint="chat", http_status=200), provider.get_tracer("t"))
    again = exporter.get_finished_spans()
    assert len(again) == 6 and IDS.trace_id not in {s.context.trace_id for s in again}
    assert not {IDS.prefill_span_id, IDS.decode_span_id} & {s.context.span_id for s in again}


def test_a_colocated_request_gives_its_decode_span_the_decode_id_and_spends_no_preset() -> None:
    provider, exporter = _preset_provider()
    tr = _pd_trace()
    tr.mode, tr.prefill_start, tr.prefill_end, tr.transfer = "colocated", None, None, None
    record_spans(request_record(tr, endpoint="chat", http_status=200), provider.get_tracer("t"), IDS)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"tandem.request", "tandem.route", "tandem.decode", "tandem.stream"}
    assert spans["tandem.decode"].context.span_id == IDS.decode_span_id
    assert IDS.prefill_span_id not in {s.context.span_id for s in spans.values()}


def test_without_preset_ids_the_generator_draws_random_ones() -> None:
    gen = PresetIds()
    assert (
        len({gen.generate_trace_id() for _ in range(50)}) == 50
        and len({gen.generate_span_id() for _ in range(50)}) == 50
    )
    with gen.preset(trace_id=7, span_id=9):
        assert gen.generate_trace_id() == 7 and gen.generate_span_id() == 9
        assert gen.generate_span_id() != 9  # once only
    with gen.preset(span_id=9):
        pass  # a preset nobody used is gone when its block ends
    assert gen.generate_span_id() != 9
    # A provider that does not take presets (not made by tracer_provider) gets random ids, not a failure.
    exporter = InMemorySpanExporter()
    plain = TracerProvider()
    plain.add_span_processor(SimpleSpanProcessor(exporter))
    record_spans(request_record(_pd_trace(), endpoint="chat", http_status=200), plain.get_tracer("t"), IDS)
    assert len(exporter.get_finished_spans()) == 6
    assert IDS.trace_id not in {s.context.trace_id for s in exporter.get_finished_spans()}


def test_spans_reach_an_otlp_http_endpoint_with_the_preset_ids() -> None:
    with OtlpCollector() as collector:
        provider = tracer_provider(collector.url)
        assert provider is not None
        try:
            record_spans(request_record(_pd_trace(), endpoint="chat", http_status=200), provider.get_tracer("t"), IDS)
            assert provider.force_flush(timeout_millis=10_000)
        finally:
            provider.shutdown()
        spans = {s.name: s for s in collector.wait_for(lambda spans: len(spans) >= 6, timeout_s=1)}
    assert collector.posts and all(p == "/v1/traces application/x-protobuf" for p in collector.posts)
    assert set(spans) == set(PD_WALK)
    assert {s.service for s in spans.values()} == {"tandem-router"}
    assert {s.trace_id for s in spans.values()} == {IDS.trace_id}
    assert (
        spans["tandem.prefill"].span_id == IDS.prefill_span_id and spans["tandem.decode"].span_id == IDS.decode_span_id
    )
    assert spans["tandem.request"].parent_span_id is None
    assert spans["tandem.prefill"].parent_span_id == spans["tandem.request"].span_id
