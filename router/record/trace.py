"""The request trace: what happened to one request, filled as it goes, read once it ends.

Every room writes into a request's ``RequestTrace``: the edge (arrival, session, tenant, the answer's
text and tool calls), planning (the resolved model, the routing decision, legs, peer fetch, retention),
the relay (tokens, usage). The record room reads it once the request ends: the lake's ``requests`` row
(``router.record.records``), metrics, spans (``router.record.accounting``), the session turn
(``router.record.turns``). It lives here, below every room, so that each may import it and none has to
import another for it.

The functions that fill it from what other modules hand over (a model resolution, a routing decision,
an engine's usage) sit beside it, so that each field has one writer per fact.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from router.admission.priority_class import Priority
from router.kv_index import MissAttribution, PrefixView, attribute
from router.model_table import Resolution
from router.policies.base import Candidate, Decision, ReasonCode

Kind = Literal["chat", "completion"]
RouteMode = Literal["disaggregated", "colocated"]


@dataclass
class RequestTrace:
    """What happened to one request: the raw material of its telemetry record."""

    request_id: str
    kind: Kind
    model: str
    """The served model that answered (after alias, canary and fallback: ``router.model_table``)."""
    requested_model: str | None = None
    """The client's ``model`` as it came (an alias, a canary name, a served name); None until resolved."""
    model_resolution: str | None = None
    """How ``model`` was resolved (``router.model_table.Via``); None until resolved."""
    arrival: float = field(default_factory=time.time)
    routed: float | None = None
    prefill_start: float | None = None
    prefill_end: float | None = None
    first_token: float | None = None
    finish: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    fleet_cached_tokens: int | None = None
    routed_cached_tokens: int | None = None
    engine_cached_tokens: int | None = None
    """Prompt tokens the engine that prefilled reused (the prefill node's figure in P/D)."""
    mode: RouteMode | None = None
    prefill_node: str | None = None
    decode_node: str | None = None
    policy: str | None = None
    reason: str | None = None
    """The decision in a sentence (display only; ``reason_code`` is the data)."""
    reason_code: ReasonCode | None = None
    """Why the node that prefills was chosen (``router.policies.ReasonCode``)."""
    decode_reason_code: ReasonCode | None = None
    reason_threshold: float | None = None
    """The threshold ``reason_code``'s rule compared against, if any."""
    reason_load: float | None = None
    """The load figure ``reason_code``'s rule compared, if any."""
    prefix_view: PrefixView | None = None
    """What the fleet index said about the prompt at routing time (``router.kv_index.attribution``)."""
    miss: MissAttribution | None = None
    """The uncached tokens by kind, once the engine said what it reused (``settle_miss``)."""
    fallback: bool = False
    stream: bool = False
    transport: str = "http"  # or websocket: one message on a socket (router.edge.codecs.websocket)
    session_id: str | None = None
    tenant_id: str | None = None
    retention_s: float | None = None
    """The TTL this request asked its host tier to keep its context for (``router.planning.retention``)."""
    decode_role: str | None = None
    kv_connector: str | None = None
    transfer: dict[str, Any] | None = None
    """How the KV transfer went: ok, bytes, seconds, transport, reason, start, end. Non-streamed
    answers carry the decode engine's own report; for streamed ones the accounting asks the prefill
    node afterwards (``kv_transfer.control.lease_report``)."""
    kv_params: dict[str, Any] | None = None
    """The prefill leg's kv_transfer_params (P/D), or the peer's of a prefix fetch: where the KV waited."""
    peer_node: str | None = None
    """The peer a prefix was loaded from (``router.planning.peer_fetch``); None: no fetch."""
    peer_tokens: int = 0
    """Prompt tokens the serving node was to load from ``peer_node``."""
    peer_outcome: str | None = None
    """How a fetch a peer could serve went (``tandem_peer_fetch_total``'s outcome); None: no peer could."""
    split_cached: tuple[int, int] | None = None
    """A split prefill (``router.planning.split_prefill``): the serving node's own hit as the router saw it,
    and the helper's hit on the prefix (its answer's); their sum is the request's cache hit."""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    """Tool calls in the answer by index: id, name, arguments (streamed fragments joined)."""
    finish_reason: str | None = None
    priority: Priority = Priority.INTERACTIVE
    """Admission class (the key's, lowered by ``x-tandem-priority``)."""
    deadline: float | None = None
    """``time.monotonic()`` by which the request must hold its node slots, else it is dropped unserved;
    None: no admission queueing."""
    status: str = "ok"
    error: str | None = None
    token_times: list[float] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    """The answer's text as it was sent (for the session's turn record)."""
    trace_id: int | None = None
    """OpenTelemetry trace id (128 bits) of this request's spans, sent to its engines in ``traceparent``
    so that vLLM's spans join the router's (``telemetry.tracing``). Drawn when the first leg goes out,
    and only with an OTLP endpoint configured; None: no header, random ids for any spans."""
    prefill_span_id: int | None = None
    """Span id (64 bits) of ``tandem.prefill``: the parent the prefill leg's ``traceparent`` names."""
    decode_span_id: int | None = None
    """Span id of ``tandem.decode``: the parent the decode leg's (and a retried leg's) ``traceparent`` names."""

    def add_tool_call_delta(self, delta: dict[str, Any]) -> None:
        """Merge one tool-call delta (streamed) or whole call (non-streamed) into ``tool_calls``."""
        call = self.tool_calls.setdefault(int(delta.get("index", 0)), {"id": "", "name": "", "arguments": ""})
        fn = delta.get("function") or {}
        call["id"] = delta.get("id") or call["id"]
        call["name"] = fn.get("name") or call["name"]
        call["arguments"] += fn.get("arguments") or ""


def new_request_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


REQUEST_ID = re.compile(r"(?:chatcmpl|cmpl)-[0-9a-f]{32}")
"""The shape of every id ``new_request_id`` makes."""


def note_decode_node(trace: RequestTrace, node: Candidate) -> None:
    """The node that serves the request's answer (its decode leg)."""
    trace.decode_node, trace.decode_role = node.node_id, node.node.info.role.value


def note_pair(trace: RequestTrace, prefill: Candidate) -> None:
    """A P/D pair: ``prefill`` computes the prompt, its connector moves the KV to the decode node."""
    trace.mode, trace.prefill_node = "disaggregated", prefill.node_id
    trace.kv_connector = prefill.node.info.kv_connector


def note_colocated(trace: RequestTrace) -> None:
    """The pair's prefill leg failed and the decode node prefills for itself: no transfer any more."""
    trace.mode, trace.kv_connector, trace.kv_params = "colocated", None, None


def note_peer_fetch(trace: RequestTrace, source: str, prefix_tokens: int, own_tokens: int) -> None:
    """The serving node loads the first ``prefix_tokens`` of the prompt from ``source``
    (``router.planning.peer_fetch``), ``own_tokens`` of them already its own; for miss attribution the
    routed prefix becomes the fetched one."""
    trace.peer_node, trace.peer_tokens = source, prefix_tokens - own_tokens
    trace.kv_connector = "tandem"
    if trace.prefix_view is not None:
        trace.prefix_view = replace(
            trace.prefix_view,
            routed_tokens=prefix_tokens,
            routed_tier_tokens=0,
            routed_peer_tokens=trace.peer_tokens,
        )
        trace.routed_cached_tokens = prefix_tokens


def note_split(trace: RequestTrace, helper: str, prefix_tokens: int, local_tokens: int) -> None:
    """``helper`` computes the first ``prefix_tokens`` while the serving node, which holds
    ``local_tokens`` of them, computes the rest (``router.planning.split_prefill``). The prefix is
    computed, not cached: the routed view is left as it is, and the hit is the two engines' own."""
    trace.peer_node, trace.peer_tokens = helper, prefix_tokens - local_tokens
    trace.kv_connector = "tandem"
    trace.split_cached = (local_tokens, 0)


def note_retry(trace: RequestTrace, target: Candidate, why: str) -> None:
    """The decode leg failed before its first token and ``target`` serves the request alone. A peer
    fetch went with the failed leg: the retry computes or hits, so its prefix no longer counts."""
    if trace.peer_node is not None:
        if trace.prefix_view is not None:
            view = trace.prefix_view
            trace.prefix_view = replace(
                view, routed_tokens=view.routed_tokens - view.routed_peer_tokens, routed_peer_tokens=0
            )
        trace.peer_node, trace.peer_tokens, trace.kv_params = None, 0, None
    trace.split_cached = None
    trace.fallback, trace.mode = True, "colocated"
    note_decode_node(trace, target)
    trace.reason = f"{trace.reason}; decode leg failed, {why}"


class RateSink(Protocol):
    """What a finished request's measurements go to (``router.planning.peer_fetch.FetchRates``)."""

    def observe_prefill(self, node_id: str, uncached_tokens: int, seconds: float) -> None: ...

    def observe_transfer(self, tokens: int, seconds: float) -> None: ...


def note_resolution(trace: RequestTrace, resolution: Resolution) -> None:
    """The resolved model into the trace: what answers, what was asked for, and how one became the other."""
    trace.model, trace.model_resolution = resolution.served, resolution.via.value
    trace.requested_model = resolution.requested


def note_decision(trace: RequestTrace, decision: Decision) -> None:
    """The routing decision into the trace, as data (codes and figures) and as a sentence."""
    trace.policy, trace.reason = decision.policy, decision.reason
    trace.reason_code, trace.decode_reason_code = decision.code, decision.decode_code
    trace.reason_threshold, trace.reason_load = decision.threshold, decision.load


def note_rates(rates: RateSink, trace: RequestTrace) -> None:
    """What a finished request measured for ``router.planning.peer_fetch``: a colocated prefill's time per uncached
    token, or a peer fetch's transfer time per token moved."""
    if trace.status != "ok" or trace.mode != "colocated" or trace.decode_node is None:
        return
    if trace.split_cached is not None:
        return  # its pull's time and its first token's both include the helper's computing
    if trace.peer_node is not None:
        report = trace.transfer or {}
        if report.get("ok"):  # the pull's own report, or the peer's lease report (a streamed answer)
            rates.observe_transfer(trace.peer_tokens, float(report.get("seconds") or 0.0))
        return
    if trace.peer_outcome in ("source_failed", "source_slow"):
        return  # its time includes the source leg it waited for
    # Streamed only: a non-streamed answer's first token is only known as its end (the decode included).
    if not trace.stream or trace.fallback or trace.first_token is None or trace.routed is None:
        return
    uncached = (trace.prompt_tokens or 0) - (trace.engine_cached_tokens or 0)
    rates.observe_prefill(trace.decode_node, uncached, trace.first_token - trace.routed)


def settle_miss(trace: RequestTrace) -> MissAttribution | None:
    """The request's miss attribution, once both the routing-time view and the engine's figure exist."""
    if trace.miss is None and trace.prefix_view is not None and trace.engine_cached_tokens is not None:
        trace.miss = attribute(trace.prefix_view, trace.engine_cached_tokens)
    return trace.miss


def record_usage(trace: RequestTrace, usage: dict[str, Any] | None) -> None:
    """Take the decode engine's usage into the trace, and put the hit-rate breakdown into the usage the
    client sees: ``prompt_tokens_details.cached_tokens`` is the engine figure of the engine that
    prefilled (in P/D the decode node reports the transferred KV as cached, which is no cache hit)."""
    if not usage:
        return
    trace.prompt_tokens = usage.get("prompt_tokens", trace.prompt_tokens)
    trace.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    if trace.mode != "disaggregated":
        cached = details.get("cached_tokens")
        if trace.split_cached is not None and cached is not None:
            # The serving engine counts the prefix it loaded as cached; the helper computed it.
            cached = min(cached, sum(trace.split_cached))
        trace.engine_cached_tokens = cached
    trace.cached_tokens = trace.engine_cached_tokens
    usage["prompt_tokens_details"] = {**details, "cached_tokens": trace.engine_cached_tokens or 0}
    miss = settle_miss(trace)
    usage["tandem"] = {
        "fleet_cached_tokens": trace.fleet_cached_tokens,
        "routed_cached_tokens": trace.routed_cached_tokens,
        "engine_cached_tokens": trace.engine_cached_tokens,
        "uncached_tokens": miss.uncached if miss else None,
        "miss": miss.usage() if miss else None,
        "kv_origin": miss.origin() if miss else None,
        "policy": trace.policy,
        "mode": trace.mode,
        "reason_code": trace.reason_code.value if trace.reason_code else None,
        "decode_reason_code": trace.decode_reason_code.value if trace.decode_reason_code else None,
        "threshold": trace.reason_threshold,
        "load": trace.reason_load,
        "reason": trace.reason,
    }


def note_answer(trace: RequestTrace, resp: dict[str, Any]) -> None:
    """A whole (not streamed) answer into the trace: its end, transfer report, usage, text and tool
    calls. The transfer report is taken out of the answer (it is the cluster's, not the client's)."""
    trace.first_token = trace.finish = time.time()
    trace.transfer = (resp.pop("kv_transfer_params", None) or {}).get("tandem_transfer")
    record_usage(trace, resp.get("usage"))
    for choice in resp.get("choices") or []:
        trace.finish_reason = choice.get("finish_reason") or trace.finish_reason
        trace.content.append((choice.get("message") or {}).get("content") or choice.get("text") or "")
        for i, call in enumerate((choice.get("message") or {}).get("tool_calls") or []):
            trace.add_tool_call_delta({**call, "index": i})
