"""A finished request's ``RequestTrace`` as a telemetry ``requests`` record (telemetry.schemas)."""

from __future__ import annotations

import json
import statistics
from typing import Any

from router.record.trace import RequestTrace, settle_miss

_NO_MISS: dict[str, Any] = {
    "uncached_tokens": None,
    "miss_cold_tokens": None,
    "miss_evicted_tokens": None,
    "miss_elsewhere_tokens": None,
    "miss_undelivered_tokens": None,
    "miss_evicted_node": None,
    "miss_evicted_tier": None,
    "miss_evicted_ago_s": None,
    "miss_elsewhere_node": None,
    "miss_elsewhere_reason": None,
    "local_cached_tokens": None,
    "host_tier_cached_tokens": None,
    "peer_cached_tokens": None,
}


def p99(values: list[float]) -> float:
    """The 99th percentile of two or more values, as ``statistics.quantiles(values, n=100,
    method="inclusive")[98]`` gives it (its formula, so the same float), without the 98 other cut points
    it computes: that call was most of a finished request's record (13 of 19 us)."""
    data = sorted(values)
    j, delta = divmod(99 * (len(data) - 1), 100)
    return (data[j] * (100 - delta) + data[j + 1] * delta) / 100


def request_record(
    trace: RequestTrace, *, endpoint: str, http_status: int, error_type: str | None = None
) -> dict[str, Any]:
    gaps = [b - a for a, b in zip(trace.token_times, trace.token_times[1:], strict=False)]
    decision = None
    if trace.mode == "disaggregated":
        decision = "pd"
    elif trace.mode == "colocated":
        decision = "decode_only" if trace.decode_role == "decode" else "colocated"
    xfer = trace.transfer or {}
    miss = settle_miss(trace)
    return {
        "request_id": trace.request_id,
        "response_id": trace.request_id,
        "session_id": trace.session_id,
        "tenant_id": trace.tenant_id,
        "model": trace.model,
        "requested_model": trace.requested_model,
        "model_resolution": trace.model_resolution,
        "endpoint": endpoint,
        "api": endpoint,  # every API's route is named after it (router.edge.app)
        "stream": trace.stream,
        "transport": trace.transport,
        "prefill_node": trace.prefill_node if trace.mode == "disaggregated" else None,
        "decode_node": trace.decode_node,
        "t_arrival": trace.arrival,
        "t_routed": trace.routed,
        "t_prefill_start": trace.prefill_start,
        "t_prefill_end": trace.prefill_end,
        "t_first_token": trace.first_token,
        "t_finish": trace.finish,
        "ttft_s": trace.first_token - trace.arrival if trace.first_token else None,
        "itl_mean_s": statistics.fmean(gaps) if gaps else None,
        "itl_p99_s": p99(gaps) if len(gaps) > 1 else None,
        "e2e_s": trace.finish - trace.arrival if trace.finish else None,
        "prompt_tokens": trace.prompt_tokens,
        "completion_tokens": trace.completion_tokens,
        "cached_tokens": trace.cached_tokens,
        "fleet_cached_tokens": trace.fleet_cached_tokens,
        "routed_cached_tokens": trace.routed_cached_tokens,
        "engine_cached_tokens": trace.engine_cached_tokens,
        "routing_policy": trace.policy,
        "routing_decision": decision,
        "routing_reason": trace.reason,
        "routing_reason_code": trace.reason_code.value if trace.reason_code else None,
        "routing_decode_reason_code": trace.decode_reason_code.value if trace.decode_reason_code else None,
        "routing_threshold": trace.reason_threshold,
        "routing_load": trace.reason_load,
        **(miss.record() if miss else _NO_MISS),
        "kv_connector": trace.kv_connector,
        "num_tool_calls": len(trace.tool_calls),
        "t_transfer_start": xfer.get("start"),
        "t_transfer_end": xfer.get("end"),
        "transfer_bytes": xfer.get("bytes"),
        "transfer_s": xfer.get("seconds"),
        "transfer_transport": xfer.get("transport"),
        "finish_reason": trace.finish_reason,
        "status": trace.status,
        "http_status": http_status,
        "error_type": error_type,
        "error_message": trace.error,
    }


def tool_call_records(trace: RequestTrace) -> list[dict[str, Any]]:
    rows = []
    for index, call in sorted(trace.tool_calls.items()):
        try:
            json.loads(call["arguments"])
            valid = True
        except ValueError:
            valid = False
        rows.append(
            {
                "request_id": trace.request_id,
                "response_id": trace.request_id,
                "session_id": trace.session_id,
                "tenant_id": trace.tenant_id,
                "model": trace.model,
                "call_index": index,
                "tool_call_id": call["id"],
                "tool_name": call["name"],
                "arguments": call["arguments"],
                "arguments_valid_json": valid,
            }
        )
    return rows
