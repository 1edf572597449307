"""OpenTelemetry spans for a request's walk, built from its ``requests`` record when it ends.

The router already stamps every step of a request (``telemetry.schemas`` requests: ``t_arrival``,
``t_routed``, ``t_prefill_start``/``_end``, ``t_transfer_start``/``_end``, ``t_first_token``,
``t_finish``), so the spans are made afterwards, off the fast path, with those times:

    tandem.request        t_arrival -> t_finish              root: ids, policy, reason code, hit and miss figures
      tandem.route        t_arrival -> t_routed              admission, tokenizing, the policy's choice
      tandem.prefill      t_prefill_start -> t_prefill_end   P/D only: the prefill leg on the prefill node
      tandem.decode       t_prefill_end (else t_routed) -> t_finish   the decode leg, which holds:
        tandem.kv_transfer  t_transfer_start -> t_transfer_end   the decode node's pull of the KV
        tandem.stream     t_first_token -> t_finish          tokens flowing to the client
    so the walk reads in order: route, prefill, transfer, first token, stream.

A step the record has no times for has no span. ``tracer_provider(endpoint)`` gives an SDK provider
that exports over OTLP (HTTP/protobuf) in batches when an endpoint is configured, and None otherwise:
with no endpoint nothing is built or sent. The router calls ``record_spans`` from its accounting when
``TANDEM_ROUTER_OTLP_TRACES_ENDPOINT`` is set. Not done yet: handing the trace context to the engines
(``traceparent`` on the legs' requests) so that vLLM's own spans (``--otlp-traces-endpoint``) join
this trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_ROOT_ATTRS = (
    "request_id",
    "session_id",
    "tenant_id",
    "model",
    "routing_policy",
    "routing_decision",
    "routing_reason_code",
    "prefill_node",
    "decode_node",
    "prompt_tokens",
    "completion_tokens",
    "fleet_cached_tokens",
    "routed_cached_tokens",
    "engine_cached_tokens",
    "uncached_tokens",
    "miss_cold_tokens",
    "miss_evicted_tokens",
    "miss_elsewhere_tokens",
    "miss_undelivered_tokens",
    "status",
    "http_status",
)


def tracer_provider(endpoint: str | None, service: str = "tandem-router") -> TracerProvider | None:
    """An OTLP-exporting provider for ``endpoint`` (e.g. ``http://127.0.0.1:4318/v1/traces``), or None."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def _ns(v: Any) -> int | None:
    """A record's instant (epoch seconds or datetime) in epoch nanoseconds, to the microsecond (the lake's
    precision; a float's nanoseconds are noise)."""
    if v is None:
        return None
    seconds = v.timestamp() if isinstance(v, datetime) else float(v)
    return round(seconds * 1e6) * 1000


def record_spans(record: Mapping[str, Any], tracer: trace.Tracer) -> None:
    """Emit one trace for one finished request (see the module docstring)."""
    start, end = _ns(record.get("t_arrival")), _ns(record.get("t_finish"))
    if start is None or end is None:
        return
    attrs = {k: record[k] for k in _ROOT_ATTRS if record.get(k) is not None}
    root = tracer.start_span("tandem.request", start_time=start, attributes=attrs)
    ctx = trace.set_span_in_context(root)

    def child(name: str, a: int | None, b: int | None, parent: Any = ctx, **attributes: Any) -> Any:
        if a is None or b is None:
            return None
        span = tracer.start_span(
            name, context=parent, start_time=a, attributes={k: v for k, v in attributes.items() if v is not None}
        )
        span.end(end_time=max(a, b))
        return span

    routed = _ns(record.get("t_routed"))
    child("tandem.route", start, routed, reason_code=record.get("routing_reason_code"))
    p0, p1 = _ns(record.get("t_prefill_start")), _ns(record.get("t_prefill_end"))
    child("tandem.prefill", p0, p1, node=record.get("prefill_node"))
    d0 = p1 if p1 is not None else routed
    if d0 is not None:
        decode = tracer.start_span(
            "tandem.decode", context=ctx, start_time=d0, attributes={"node": record.get("decode_node") or ""}
        )
        in_decode = trace.set_span_in_context(decode)
        child(
            "tandem.kv_transfer",
            _ns(record.get("t_transfer_start")),
            _ns(record.get("t_transfer_end")),
            parent=in_decode,
            bytes=record.get("transfer_bytes"),
            transport=record.get("transfer_transport"),
        )
        child("tandem.stream", _ns(record.get("t_first_token")), end, parent=in_decode)
        decode.end(end_time=max(d0, end))
    root.end(end_time=end)
