"""What happens when a request ends, whatever way it ends: one record, to metrics and to the lake.

Nothing here waits on I/O: the emitter only appends to its buffer, the response index writes from a
background task, and Prometheus objects are in memory.
"""

from __future__ import annotations

import time
from typing import Any

from infra.errors import TandemError
from router.admission.ratelimit import Admission
from router.metrics import RouterMetrics
from router.orchestrator import RequestTrace
from router.records import request_record, tool_call_records
from router.responses import ResponseIndex, ResponseRef
from router.turns import TurnRecorder
from telemetry import Emitter


class Accounting:
    def __init__(self, metrics: RouterMetrics, emitter: Emitter | None, responses: ResponseIndex | None,
                 turns: TurnRecorder | None = None) -> None:
        self.metrics = metrics
        self.emitter = emitter
        self.responses = responses
        self.turns = turns

    def finish(self, trace: RequestTrace, endpoint: str, status: str, *, http_status: int,
               exc: TandemError | None = None, admission: Admission | None = None,
               messages: list[dict[str, Any]] | None = None) -> None:
        trace.finish = trace.finish or time.time()
        trace.status = status
        if exc is not None:
            trace.error = exc.message
            self.metrics.errors.labels(type(exc).__name__).inc()
        record = request_record(trace, endpoint=endpoint, http_status=http_status,
                                error_type=type(exc).__name__ if exc else None)
        self.metrics.common.observe_request(record)
        if self.emitter is not None:
            self.emitter.emit("requests", record)
            for row in tool_call_records(trace):
                self.emitter.emit("tool_calls", row)
        if status == "ok" and self.responses is not None:
            self.responses.remember(trace.request_id, ResponseRef(trace.request_id, trace.session_id,
                                                                   trace.tenant_id))
        if self.turns is not None and admission is not None:
            self.turns.after(trace, admission, messages)
