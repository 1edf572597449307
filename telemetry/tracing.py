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
``TANDEM_ROUTER_OTLP_TRACES_ENDPOINT`` is set.

Joined with vLLM's own spans: with an endpoint configured, the router draws a request's trace id and
the span ids of its ``tandem.prefill`` and ``tandem.decode`` spans before the legs go out
(``RequestTrace.trace_id``, ``prefill_span_id``, ``decode_span_id``) and sends each leg a W3C
``traceparent`` naming its span. An engine started with ``--otlp-traces-endpoint`` (a node with
``TANDEM_NODE_OTLP_TRACES_ENDPOINT``) parents its ``llm_request`` span on that header. When the request
ends, ``record_spans(record, tracer, ids)`` gives the router's spans those same ids: the provider's
id generator (``PresetIds``) returns a preset id for the next span it is asked for, else a random one.
So the prefill engine's span nests under ``tandem.prefill`` and the decode engine's (or a retried leg's)
under ``tandem.decode``, in one trace.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

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


@dataclass(frozen=True)
class SpanIds:
    """Ids drawn before a request's legs went out (and sent in their ``traceparent``), for its spans."""

    trace_id: int
    prefill_span_id: int | None = None
    """``tandem.prefill``'s span id: the parent the prefill leg named."""
    decode_span_id: int | None = None
    """``tandem.decode``'s span id: the parent the decode leg (or its retry) named."""


class _Next(threading.local):
    trace_id: int | None = None
    span_id: int | None = None


class PresetIds(IdGenerator):
    """Random ids (``RandomIdGenerator``), except that ``preset`` chooses the next trace id and span id
    this thread's spans get: each preset is used once, and cleared when its block ends."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._next = _Next()

    @contextmanager
    def preset(self, *, trace_id: int | None = None, span_id: int | None = None) -> Iterator[None]:
        self._next.trace_id, self._next.span_id = trace_id, span_id
        try:
            yield
        finally:
            self._next.trace_id = self._next.span_id = None

    def generate_trace_id(self) -> int:
        preset, self._next.trace_id = self._next.trace_id, None
        return preset if preset else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        preset, self._next.span_id = self._next.span_id, None
        return preset if preset else self._random.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return True  # preset ones too: the router draws them with random.getrandbits


def tracer_provider(endpoint: str | None, service: str = "tandem-router") -> TracerProvider | None:
    """An OTLP-exporting provider for ``endpoint`` (e.g. ``http://127.0.0.1:4318/v1/traces``), or None.
    Its id generator is a ``PresetIds``, so ``record_spans`` can give spans the ids sent to the engines."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=PresetIds())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def _ns(v: Any) -> int | None:
    """A record's instant (epoch seconds or datetime) in epoch nanoseconds, to the microsecond (the lake's
    precision; a float's nanoseconds are noise)."""
    if v is None:
        return None
    seconds = v.timestamp() if isinstance(v, datetime) else float(v)
    return round(seconds * 1e6) * 1000


def _preset_ids(tracer: trace.Tracer) -> PresetIds | None:
    """The tracer's id generator, if it takes presets (a provider from ``tracer_provider``)."""
    if isinstance(tracer, sdk_trace.Tracer) and isinstance(tracer.id_generator, PresetIds):
        return tracer.id_generator
    return None


def record_spans(record: Mapping[str, Any], tracer: trace.Tracer, ids: SpanIds | None = None) -> None:
    """Emit one trace for one finished request (see the module docstring). ``ids``: the trace id and the
    prefill and decode span ids its legs' ``traceparent`` named; they are used when the tracer's provider
    generates ids with ``PresetIds``, and ignored (random ids) otherwise."""
    start, end = _ns(record.get("t_arrival")), _ns(record.get("t_finish"))
    if start is None or end is None:
        return
    gen = _preset_ids(tracer) if ids is not None else None

    def start_span(name: str, parent: Any, a: int, attributes: dict[str, Any], span_id: int | None = None) -> Any:
        if gen is None or ids is None:
            return tracer.start_span(name, context=parent, start_time=a, attributes=attributes)
        trace_id = ids.trace_id if parent is None else None  # a child takes its parent's trace id
        with gen.preset(trace_id=trace_id, span_id=span_id):
            return tracer.start_span(name, context=parent, start_time=a, attributes=attributes)

    attrs = {k: record[k] for k in _ROOT_ATTRS if record.get(k) is not None}
    root = start_span("tandem.request", None, start, attrs)
    ctx = trace.set_span_in_context(root)

    def child(
        name: str, a: int | None, b: int | None, parent: Any = ctx, span_id: int | None = None, **attributes: Any
    ) -> Any:
        if a is None or b is None:
            return None
        span = start_span(name, parent, a, {k: v for k, v in attributes.items() if v is not None}, span_id)
        span.end(end_time=max(a, b))
        return span

    routed = _ns(record.get("t_routed"))
    child("tandem.route", start, routed, reason_code=record.get("routing_reason_code"))
    p0, p1 = _ns(record.get("t_prefill_start")), _ns(record.get("t_prefill_end"))
    child("tandem.prefill", p0, p1, span_id=ids.prefill_span_id if ids else None, node=record.get("prefill_node"))
    d0 = p1 if p1 is not None else routed
    if d0 is not None:
        decode = start_span(
            "tandem.decode",
            ctx,
            d0,
            {"node": record.get("decode_node") or ""},
            ids.decode_span_id if ids else None,
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
