"""What happens when a request ends, whatever way it ends: one record, to metrics and to the lake.

Nothing here waits on I/O: the emitter only appends to its buffer, the response index writes from a
background task, and Prometheus objects are in memory. The one record that needs a network answer (a
streamed P/D answer's KV transfer figures, which only the prefill node can give) is completed and
emitted from a background task.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from contracts.errors import TandemError
from kv_transfer.control import is_tandem_params, lease_report
from router.admission.ratelimit import Admission
from router.planning.orchestrator import RequestTrace, note_rates
from router.planning.peer_fetch import FetchRates
from router.record.metrics import RouterMetrics
from router.record.records import request_record, tool_call_records
from router.record.responses import ResponseIndex, ResponseRef
from router.record.turns import TurnRecorder
from telemetry import Emitter
from telemetry.tracing import SpanIds, record_spans

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


class Accounting:
    def __init__(
        self,
        metrics: RouterMetrics,
        emitter: Emitter | None,
        responses: ResponseIndex | None,
        turns: TurnRecorder | None = None,
        spawn: Callable[[Coroutine[Any, Any, Any]], None] | None = None,
        tracer: Tracer | None = None,
        rates: FetchRates | None = None,
    ) -> None:
        self.metrics = metrics
        self.rates = rates
        """What finished requests measured for cross-node prefix reuse (``router.planning.peer_fetch``)."""
        self.tracer = tracer
        """OpenTelemetry spans of each finished request (``telemetry.tracing``); None: none built."""
        self.emitter = emitter
        self.responses = responses
        self.turns = turns
        self.spawn = spawn

    def finish(
        self,
        trace: RequestTrace,
        endpoint: str,
        status: str,
        *,
        http_status: int,
        exc: TandemError | None = None,
        admission: Admission | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> None:
        trace.finish = trace.finish or time.time()
        trace.status = status
        if exc is not None:
            trace.error = exc.message
            self.metrics.errors.labels(type(exc).__name__).inc()
        error_type = type(exc).__name__ if exc else None
        if (
            trace.transfer is None
            and (trace.mode == "disaggregated" or trace.peer_node is not None)
            and is_tandem_params(trace.kv_params)
            and self.spawn is not None
        ):
            self.spawn(self._record_after_report(trace, endpoint, http_status, error_type))
        else:
            self._record(trace, endpoint, http_status, error_type)
        if status == "ok" and self.responses is not None:
            self.responses.remember(trace.request_id, ResponseRef(trace.request_id, trace.session_id, trace.tenant_id))
        if self.turns is not None and admission is not None:
            self.turns.after(trace, admission, messages)

    def _record(self, trace: RequestTrace, endpoint: str, http_status: int, error_type: str | None) -> None:
        if self.rates is not None:
            note_rates(self.rates, trace)
        record = request_record(trace, endpoint=endpoint, http_status=http_status, error_type=error_type)
        self.metrics.common.observe_request(record)
        self.metrics.transports.labels(endpoint, trace.transport).inc()
        if self.tracer is not None:
            # span objects only; the provider's thread exports them. The ids are those the legs'
            # traceparent named (Orchestrator._headers), so the engines' spans nest under these.
            ids = None
            if trace.trace_id is not None:
                ids = SpanIds(trace.trace_id, trace.prefill_span_id, trace.decode_span_id)
            record_spans(record, self.tracer, ids)
        if self.emitter is not None:
            self.emitter.emit("requests", record)
            for row in tool_call_records(trace):
                self.emitter.emit("tool_calls", row)

    async def _record_after_report(
        self, trace: RequestTrace, endpoint: str, http_status: int, error_type: str | None
    ) -> None:
        try:
            trace.transfer = await lease_report(trace.kv_params or {})
        finally:  # the record is emitted whatever the prefill node says, or if it says nothing
            self._record(trace, endpoint, http_status, error_type)
