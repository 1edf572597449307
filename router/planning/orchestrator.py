"""P/D orchestration: validate against the fleet, pick nodes, run the prefill leg, open the decode leg.

    request ─▶ pools(model) ─▶ policy.select ─▶ [prefill leg: max_tokens=1, do_remote_decode]
                                                     │ kv_transfer_params (where the KV waits)
                                                     ▼
                                              decode leg (stream or not) ─▶ client

Everything up to the opening of the decode leg happens before the router answers, so any refusal
(bad request, no node, engine 4xx, shed or expired in an admission queue) still gets a proper HTTP
status.

Admission slots (``router.admission.priority``), when the orchestrator has a controller: after routing,
the request takes a slot on its decode (or colocated) node, then one on its prefill node; it queues by
class then arrival for each, until ``trace.deadline``. The decode slot comes first and is held until
the answer ends (``Leg.release``), so KV computed by a prefill node never waits for a decode slot;
the prefill slot is held for the prefill leg only. A request shed or expired while queued has reached
no engine. Every request takes its slots in the same order (decode, then prefill), so none deadlock.
A decode leg retried on the prefill node (below) runs on the slots already held: it was admitted.

A prefill leg that fails for a reason that is not the client's follows ``prefill_fallback``: prefill
on the decode node, or 502.
A decode leg that fails before its first token (decode node dead, refusing, or dying mid-transfer)
releases the prefill node's lease and, under the same policy, is served once more by the prefill node
itself, which still has the prompt in its prefix cache; the client sees one answer either way.

Layer-wise pairs (``RouterSettings.layerwise``, ``router.planning.layerwise``): both legs go out at once, the
decode leg naming the prefill node's block server and a transfer id the router chose, so the decode
node pulls each layer while the prefill computes; ``plan`` returns at the first of the decode leg being
ready or the prefill leg ending, and the legs are the ``Leg``'s ``pair`` until the exchange's exit. The
prefill slot is then held by the prefill leg itself, until it ends.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from contracts.errors import EngineRejected, InvalidRequest, TandemError, Unavailable, UpstreamError
from contracts.registry import NodeInfo
from kv_transfer import prefill_request_params
from kv_transfer.control import is_tandem_params, release_lease
from router.admission.priority import AdmissionController
from router.admission.priority_class import Priority
from router.edge.schemas import ChatCompletionRequest, CompletionRequest
from router.fleet import Fleet, Pools
from router.kv_index import BlockHasher, FleetIndex, MissAttribution, PrefixView, attribute, prefix_view
from router.model_table import ModelTable, Resolution, Via
from router.planning import layerwise
from router.planning.peer_fetch import FetchPlan, FetchRates, PeerFetch
from router.planning.retention import RETAIN_FIELD, retention_default, retention_for
from router.policies.base import Candidate, Decision, ReasonCode, RoutingPolicy, RoutingRequest
from router.policies.least_loaded import LeastLoaded
from router.record.metrics import RouterMetrics
from router.settings import FallbackPolicy, RouterSettings
from router.tokenizer import PromptTokenizer
from router.upstream.node_client import NodeClient
from router.upstream.sse_upstream import SseStream

log = logging.getLogger("tandem.router")

Kind = Literal["chat", "completion"]
RouteMode = Literal["disaggregated", "colocated"]
TokenCharge = Callable[[int, int | None], Awaitable[None]]
Background = Callable[[Awaitable[Any]], None]
_PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
CAPACITY_CODES = frozenset({"overloaded", "shed"})
"""``Unavailable`` codes that mean every slot of the chosen node was taken (``router.admission.priority``):
a request refused so may still go to its model's fallback. A passed deadline is final."""


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


@dataclass
class Leg:
    """The decode leg, ready to be run: where, and with which body."""

    decision: Decision
    url: str
    body: dict[str, Any]
    hold: AsyncExitStack = field(default_factory=AsyncExitStack)
    """The decode node's admission slot. Whoever runs the leg calls ``release`` once the answer ends."""
    pair: layerwise.Pair | None = None
    """A layer-wise pair: this leg is already in flight beside its prefill leg (``router.planning.layerwise``)."""

    async def release(self) -> None:
        """End a layer-wise pair's legs if still running, give back the decode node's slot (idempotent;
        nothing inside waits, so safe under cancellation)."""
        if self.pair is not None:
            await self.pair.cancel()
        await self.hold.aclose()


def new_request_id(kind: Kind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


class Orchestrator:
    def __init__(
        self,
        settings: RouterSettings,
        fleet: Fleet,
        client: NodeClient,
        policy: RoutingPolicy,
        tokenizer: PromptTokenizer,
        metrics: RouterMetrics,
        index: FleetIndex | None = None,
        slots: AdmissionController | None = None,
        models: ModelTable | None = None,
        peers: PeerFetch | None = None,
    ) -> None:
        self.models = models or ModelTable()
        self.peers = peers
        """Cross-node prefix reuse (``router.planning.peer_fetch``); None: off."""
        self.index = index
        self.slots = slots
        self._hashers: dict[tuple[str, int], BlockHasher] = {}
        self.settings = settings
        self.fleet = fleet
        self.client = client
        self.policy = policy
        self.tokenizer = tokenizer
        self.metrics = metrics

    # -- routing ------------------------------------------------------------------------------------
    def _select(self, rr: RoutingRequest, pools: Pools, prefer: RouteMode | None) -> Decision:
        pd_ok = bool(pools.prefill and pools.decode)
        if prefer != "colocated" and pd_ok:
            decision = self.policy.select(rr, pools.prefill, pools.decode)
            if prefer == "disaggregated" and decision.prefill is None:
                # The policy chose a local prefill; the client asked for the P/D path explicitly.
                prefill = LeastLoaded().select(rr, pools.prefill, [decision.decode]).prefill
                reason = f"{decision.reason}; P/D forced by header"
                decision = replace(decision, prefill=prefill, code=ReasonCode.FORCED_PD, reason=reason)
            return decision
        if pools.colocated:
            return self.policy.select(rr, [], pools.colocated)
        if pools.decode:  # decode nodes can prefill for themselves; slower, but serves
            return self.policy.select(rr, [], pools.decode)
        if pools.prefill:
            # Every decode node is gone (a crash, a restart): a prefill engine runs the whole request
            # itself (its connector is kv_both, and with no kv_transfer_params it is a plain engine).
            return self.policy.select(rr, [], pools.prefill)
        live = "no node of it is live"
        raise Unavailable(f"no node can serve `{rr.model}` now ({live})", retry_after=self.settings.retry_after_s)

    def _pinned(self, model: str, node_id: str) -> Decision:
        """The operator's choice (``x-tandem-node``): that node alone, whatever the policy would pick."""
        node = self.fleet.pinned(model, node_id, param="x-tandem-node", retry_after=self.settings.retry_after_s)
        code = ReasonCode.PINNED
        return Decision(node, None, self.policy.name, code, code, reason=f"pinned to {node_id} by x-tandem-node")

    async def _prompt_ids(
        self, req: ChatCompletionRequest | CompletionRequest, body: dict[str, Any], node: NodeInfo, trace: RequestTrace
    ) -> list[int] | None:
        """The prompt's token ids, after checking that prompt and completion fit the context window."""
        limit = node.max_model_len
        max_tokens = self._check_max_tokens(req, node)
        ids = await self.tokenizer.token_ids(node, body)
        n = trace.prompt_tokens = len(ids) if ids is not None else None
        if n is not None and n + (max_tokens or 1) > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + (max_tokens or 1)} tokens ({n} in the messages, {max_tokens or 1} in the completion). "
                "Please reduce the length of the messages or completion.",
                param="messages" if "messages" in body else "prompt",
                code="context_length_exceeded",
            )
        return ids

    def _check_max_tokens(self, req: ChatCompletionRequest | CompletionRequest, node: NodeInfo) -> int | None:
        """The completion's max_tokens, refused when it alone fills the context window."""
        limit = node.max_model_len
        max_tokens = req.requested_max_tokens() or self.settings.default_max_tokens
        if max_tokens is not None and max_tokens >= limit:
            raise InvalidRequest(
                f"max_tokens={max_tokens} does not fit this model's context window of {limit} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _choice(self, pools: Pools) -> bool:
        """Whether routing has a choice to make that the prompt's tokens inform (``tokenize`` setting):
        more than one node could take part. With one node the router would render and encode every
        prompt (about 1 ms of CPU per 512 tokens, the largest part of its per-request cost) for a
        decision it does not have."""
        if self.settings.tokenize == "always":
            return True
        return len(pools.prefill) + len(pools.decode) + len(pools.colocated) > 1

    def _hit_breakdown(self, rr: RoutingRequest, decision: Decision, trace: RequestTrace, pools: Pools) -> None:
        """fleet_cached_tokens (best prefix anywhere) and routed_cached_tokens (on the node that will
        prefill), from the fleet KV index, whatever the policy, and the rest of what miss attribution
        needs (``router.kv_index.attribution``). Like vLLM, the last prompt token is always
        recomputed, so at most (n-1)//block_size blocks count."""
        if self.index is None or not rr.block_keys:
            return
        prefiller = decision.prefill or decision.decode
        live = {c.node_id for pool in (pools.prefill, pools.decode, pools.colocated) for c in pool}
        view = trace.prefix_view = prefix_view(
            self.index,
            rr.model,
            rr.block_keys,
            prompt_tokens=len(rr.prompt_token_ids),
            block_size=prefiller.node.info.block_size,
            routed_node=prefiller.node_id,
            live_nodes=live,
            reason_code=decision.code.value,
            now=time.time(),
        )
        trace.fleet_cached_tokens, trace.routed_cached_tokens = view.fleet_tokens, view.routed_tokens

    def _retain(self, body: dict[str, Any], decision: Decision, trace: RequestTrace) -> None:
        """Ask the prefilling node's host tier to keep this session's context (``router.planning.retention``)."""
        prefiller = (decision.prefill or decision.decode).node.info
        if not prefiller.host_tier_events_endpoint:
            return
        hint = retention_for(
            body,
            trace.session_id,
            trace.tenant_id,
            retention_default(self.settings, trace.transport),
            self.settings.session_retention_max_s,
        )
        if hint is not None:
            body["kv_transfer_params"] = hint.params()
            trace.retention_s = hint.ttl_s

    def _keys(self, node: NodeInfo, ids: list[int] | None, cache_salt: str | None) -> tuple[int, ...]:
        if ids is None or self.index is None or node.block_size <= 0:
            return ()
        hasher = self._hashers.get((node.model, node.block_size))
        if hasher is None:
            hasher = self._hashers[(node.model, node.block_size)] = BlockHasher(node.block_size, "sha256_cbor")
        return tuple(hasher.keys(ids, cache_salt=cache_salt))

    # -- legs ---------------------------------------------------------------------------------------
    async def plan(
        self,
        kind: Kind,
        req: ChatCompletionRequest | CompletionRequest,
        trace: RequestTrace,
        prefer: RouteMode | None = None,
        charge: TokenCharge | None = None,
        cache_salt: str | None = None,
        background: Background | None = None,
        pin: str | None = None,
    ) -> Leg:
        """Validate, route and run the prefill leg. Returns the decode leg to run (a layer-wise one is
        already in flight). ``charge`` is called with (prompt tokens, max_tokens) once they are known,
        before any node works (token limits). ``cache_salt`` (``router.planning.cache_salt``) goes to every engine
        leg and into the routing keys, so that the fleet index matches the engines' salted block hashes.
        ``background`` runs the lease releases of pairs given up here, off the fast path.

        The request's ``model`` is resolved first (``router.model_table``): the engines see the served
        name. If the node chosen for it refuses for capacity (its admission queue is full) and the model
        has a fallback, the request is planned once more on the fallback, uncharged (its tokens were
        charged once). ``pin`` (``x-tandem-node``) names the node that serves the request alone, instead
        of the policy; a pinned request never moves to another node or model."""
        req.check_supported()
        resolution = self.models.resolve(req.model, self.fleet.serves)
        if resolution.served not in self.fleet.model_names:  # a node may have registered since the last read
            await self.fleet.catch_up()
            resolution = self.models.resolve(req.model, self.fleet.serves)
        note_resolution(trace, resolution)
        try:
            return await self._plan_on(resolution.served, kind, req, trace, prefer, charge, cache_salt, background, pin)
        except Unavailable as exc:
            fallback = resolution.fallback
            if fallback is None or exc.code not in CAPACITY_CODES or pin is not None:
                raise
            log.warning("%s has no capacity (%s); planning on its fallback %s", trace.model, exc.message, fallback)
            note_resolution(trace, replace(resolution, served=fallback, via=Via.FALLBACK, fallback=None))
            return await self._plan_on(fallback, kind, req, trace, prefer, None, cache_salt, background)
        finally:
            if self.bounded(resolution.requested):
                self.metrics.resolutions.labels(resolution.requested, trace.model, trace.model_resolution).inc()

    def bounded(self, name: str) -> bool:
        """Whether ``name`` may be a metrics label: a name of the model table, or one a live node serves
        (a bounded set); any other client string would be a new time series, kept forever."""
        return name in self.fleet.model_names or self.models.known(name)

    async def _plan_on(
        self,
        model: str,
        kind: Kind,
        req: ChatCompletionRequest | CompletionRequest,
        trace: RequestTrace,
        prefer: RouteMode | None,
        charge: TokenCharge | None,
        cache_salt: str | None,
        background: Background | None,
        pin: str | None = None,
    ) -> Leg:
        pools = self.fleet.pools(model)
        req.model = model  # the engine serves this name (vLLM refuses any other)
        body = req.body()
        if cache_salt:
            body["cache_salt"] = cache_salt
        if self.settings.default_max_tokens and req.requested_max_tokens() is None:
            body["max_tokens"] = self.settings.default_max_tokens
        reference = (pools.decode or pools.colocated or pools.prefill)[0].node.info  # same model everywhere
        if charge is not None or self._choice(pools):
            ids = await self._prompt_ids(req, body, reference, trace)
        else:  # nothing to decide and nothing to charge: the engine counts (and checks) the prompt
            self._check_max_tokens(req, reference)
            ids = None
        if charge is not None:
            await charge(trace.prompt_tokens or 0, req.requested_max_tokens())
        rr = RoutingRequest(
            request_id=trace.request_id,
            model=trace.model,
            prompt_token_ids=tuple(ids or ()),
            session_id=trace.session_id,
            block_keys=self._keys(reference, ids, cache_salt),
        )
        decision = self._select(rr, pools, prefer) if pin is None else self._pinned(model, pin)
        trace.routed = time.time()
        hold, prefill_slot = AsyncExitStack(), AsyncExitStack()
        try:  # from here on the policy counts the decision: whatever fails settles it
            note_decision(trace, decision)
            self._hit_breakdown(rr, decision, trace, pools)
            self._retain(body, decision, trace)
            await hold.enter_async_context(self._slot(decision.decode, trace))
            await prefill_slot.enter_async_context(self._slot(decision.prefill, trace))
            leg = await self._legs(kind, body, decision, trace, prefill_slot, background, rr, pools)
        except BaseException:
            await prefill_slot.aclose()
            await hold.aclose()
            self.policy.on_complete(decision)
            raise
        leg.hold = hold
        return leg

    def _slot(self, node: Candidate | None, trace: RequestTrace) -> AbstractAsyncContextManager[None]:
        """The node's admission slot for this request (queued by class, dropped at the deadline)."""
        if node is None or self.slots is None or trace.deadline is None:
            return nullcontext()
        return self.slots.slot(node.node_id, trace.priority, trace.deadline)

    async def _legs(
        self,
        kind: Kind,
        body: dict[str, Any],
        decision: Decision,
        trace: RequestTrace,
        prefill_slot: AsyncExitStack,
        background: Background | None,
        rr: RoutingRequest | None = None,
        pools: Pools | None = None,
    ) -> Leg:
        """The decode leg to run, after the prefill leg (sequential) or beside it (layer-wise). Whoever
        runs the prefill leg closes ``prefill_slot`` when it ends. A node that prefills itself may load a
        prefix from a peer first (``router.planning.peer_fetch``)."""
        path = _PATHS[kind]
        trace.decode_node = decision.decode.node_id
        trace.decode_role = decision.decode.node.info.role.value
        if decision.prefill is None:
            trace.mode = "colocated"
            if rr is not None and pools is not None:
                body = await self._peer_prefix(body, decision.decode, rr, pools, trace)
            return Leg(decision, decision.decode.node.info.url + path, body)

        trace.mode, trace.prefill_node = "disaggregated", decision.prefill.node_id
        trace.kv_connector = decision.prefill.node.info.kv_connector
        if self.settings.layerwise and layerwise.eligible(decision.prefill, decision.decode):
            self.metrics.layerwise_pairs.inc()
            return await self._layerwise_legs(path, body, decision, decision.prefill, trace, prefill_slot, background)
        self.metrics.sequential_pairs.inc()
        trace.prefill_start = time.time()
        try:
            with self.fleet.track(decision.prefill):
                kv_params = await self._prefill(decision.prefill, path, self._prefill_body(body), trace)
        except EngineRejected as exc:
            if exc.status_code < 500:
                raise  # the client's request is at fault; another node would refuse it too
            kv_params = self._fallback(exc, trace)
        except UpstreamError as exc:
            self._node_failed(decision.prefill, exc)
            kv_params = self._fallback(exc, trace)
        finally:
            self._prefill_ended(trace)
            await prefill_slot.aclose()
        decode_body = dict(body)
        if kv_params is None:
            trace.mode, trace.kv_connector = "colocated", None
        else:
            decode_body["kv_transfer_params"] = trace.kv_params = kv_params
        return Leg(decision, decision.decode.node.info.url + path, decode_body)

    async def _layerwise_legs(
        self,
        path: str,
        body: dict[str, Any],
        decision: Decision,
        prefill: Candidate,
        trace: RequestTrace,
        prefill_slot: AsyncExitStack,
        background: Background | None,
    ) -> Leg:
        """Both legs at once (``router.planning.layerwise``): the decode leg in flight as ``leg.pair``, or, when
        the prefill leg failed first, what a sequential pair does then (its 4xx, the fallback, a 502)."""
        tid = layerwise.new_transfer_id()
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = trace.kv_params = layerwise.decode_params(
            prefill.node.info, tid, time.time() + self.settings.request_timeout_s
        )
        leg = Leg(decision, decision.decode.node.info.url + path, decode_body)
        trace.prefill_start = time.time()
        # The decode leg first: its pull is then waiting at the block server when the lease opens.
        decode_call = self._open_once(leg, trace) if body.get("stream") else self._post_decode(leg, trace)
        pair = leg.pair = layerwise.Pair(
            asyncio.ensure_future(decode_call),
            asyncio.ensure_future(self._layerwise_prefill(prefill, path, body, tid, trace, prefill_slot)),
        )
        await pair.first()
        exc = pair.prefill_failed()
        if exc is None or pair.decode.done():
            return leg  # a decode leg that is ready stands: a pull only delivers a finished prefill
        await pair.cancel()
        if background is not None:
            self.abandon(leg, f"prefill leg failed: {exc}", background)
        if isinstance(exc, EngineRejected) and exc.status_code < 500:
            raise exc  # the client's request is at fault; another node would refuse it too
        if not isinstance(exc, UpstreamError):
            raise exc
        self._node_failed(prefill, exc)
        self._fallback(exc, trace)
        trace.mode, trace.kv_connector, trace.kv_params = "colocated", None, None
        return Leg(decision, decision.decode.node.info.url + path, body)

    async def _layerwise_prefill(
        self,
        node: Candidate,
        path: str,
        body: dict[str, Any],
        tid: str,
        trace: RequestTrace,
        prefill_slot: AsyncExitStack,
    ) -> None:
        try:
            with self.fleet.track(node):
                await self._prefill(node, path, self._prefill_body(body, tid), trace)
        finally:
            self._prefill_ended(trace)
            await prefill_slot.aclose()

    async def _peer_prefix(
        self, body: dict[str, Any], target: Candidate, rr: RoutingRequest, pools: Pools, trace: RequestTrace
    ) -> dict[str, Any]:
        """``body``, given the transfer params of a prefix a peer leased for ``target`` when the measured
        rates favour loading it (``router.planning.peer_fetch``); else ``body`` as it came (``target`` computes)."""
        if self.peers is None or not rr.block_keys:
            return body
        # Colocated peers only: a prefill or decode node's engine is sized and admitted for its role.
        pool = [c for c in pools.colocated if not self.fleet.is_down(c.node_id)]
        verdict = self.peers.plan(rr.model, rr.block_keys, len(rr.prompt_token_ids), target, pool)
        if verdict is None:
            return body
        if verdict.plan is None:
            self._peer_outcome(trace, verdict.outcome)
            return body
        plan = verdict.plan
        params = await self._source_leg(body, plan, rr, trace)
        if params is None:
            return body
        out = dict(body)
        # vLLM's P/D convention: a decode engine given the prefill side's hit (remote_prefill_cached_tokens)
        # reports that as its own cached_tokens. Here the serving node's own figure is the one that counts
        # (its hit plus what it loaded), so the peer's is not passed on.
        params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
        # (beside a retention hint the body may carry: router.planning.retention)
        out["kv_transfer_params"] = trace.kv_params = {
            **(body.get("kv_transfer_params") or {}),
            **params,
            "prefix_tokens": plan.prefix_tokens,
            "prefix_key": rr.block_keys[plan.prefix_tokens // target.node.info.block_size - 1],
        }
        trace.peer_node, trace.peer_tokens = plan.source.node_id, plan.prefix_tokens - plan.own_tokens
        trace.kv_connector = "tandem"
        if trace.prefix_view is not None:  # the prefix the node now reuses, for miss attribution
            trace.prefix_view = replace(
                trace.prefix_view,
                routed_tokens=plan.prefix_tokens,
                routed_tier_tokens=0,
                routed_peer_tokens=trace.peer_tokens,
            )
            trace.routed_cached_tokens = plan.prefix_tokens
        self._peer_outcome(trace, "fetched")
        return out

    async def _source_leg(
        self, body: dict[str, Any], plan: FetchPlan, rr: RoutingRequest, trace: RequestTrace
    ) -> dict[str, Any] | None:
        """Ask the peer to lease the prefix: its transfer params, or None when it failed or took longer
        than computing would have (the leg is then cancelled: an aborted request leases nothing)."""
        assert self.peers is not None
        rates, source = self.peers.rates, plan.source
        pbody: dict[str, Any] = {
            "model": body["model"],
            "prompt": list(rr.prompt_token_ids[: plan.prefix_tokens]),
            "max_tokens": 1,
            "kv_transfer_params": prefill_request_params(),
        }
        if body.get("cache_salt"):
            pbody["cache_salt"] = body["cache_salt"]  # the same salted hashes as the request's own
        start = time.monotonic()
        try:
            async with asyncio.timeout(plan.compute_s):
                with self.fleet.track(source):
                    resp = await self.client.post_json(
                        source.node.info.url + _PATHS["completion"], pbody, self._headers(trace, "prefill")
                    )
        except TimeoutError:
            elapsed = time.monotonic() - start
            rates.observe_source(source.node_id, elapsed)  # so a slow peer is asked less
            self.metrics.peer_fetch_leg.observe(elapsed)
            self._peer_outcome(trace, "source_slow")
            return None
        except UpstreamError as exc:
            self._node_failed(source, exc)
            log.warning("prefix fetch from %s failed (%s); computing it here", source.node_id, exc.message)
            self._peer_outcome(trace, "source_failed")
            return None
        elapsed = time.monotonic() - start
        rates.observe_source(source.node_id, elapsed)
        self.metrics.peer_fetch_leg.observe(elapsed)
        params = resp.get("kv_transfer_params")
        if not is_tandem_params(params):
            log.warning("prefix fetch from %s: no transfer params in its answer; computing", source.node_id)
            self._peer_outcome(trace, "source_failed")
            return None
        return params  # type: ignore[return-value]

    def _peer_outcome(self, trace: RequestTrace, outcome: str) -> None:
        trace.peer_outcome = outcome
        self.metrics.peer_fetches.labels(outcome).inc()

    def _prefill_ended(self, trace: RequestTrace) -> None:
        trace.prefill_end = time.time()
        self.metrics.prefill_leg.observe(trace.prefill_end - (trace.prefill_start or trace.prefill_end))

    @staticmethod
    def _prefill_body(body: dict[str, Any], layerwise_id: str | None = None) -> dict[str, Any]:
        pbody = dict(body)  # only top-level keys change; the messages are shared, not copied
        for k in ("stream", "stream_options", "max_completion_tokens"):
            pbody.pop(k, None)
        pbody["max_tokens"] = 1
        params = prefill_request_params() if layerwise_id is None else layerwise.prefill_params(layerwise_id)
        # (beside a retention hint the body may carry for the prefill node's host tier: router.planning.retention)
        pbody["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **params}
        return pbody

    async def _post_decode(self, leg: Leg, trace: RequestTrace) -> dict[str, Any]:
        with self.fleet.track(leg.decision.decode):
            return await self.client.post_json(leg.url, leg.body, self._headers(trace, "decode"))

    async def _prefill(self, node: Candidate, path: str, pbody: dict[str, Any], trace: RequestTrace) -> dict:
        resp = await self.client.post_json(node.node.info.url + path, pbody, self._headers(trace, "prefill"))
        details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
        trace.engine_cached_tokens = details.get("cached_tokens")
        params = resp.get("kv_transfer_params")
        if not params:
            raise UpstreamError(
                f"prefill node {node.node_id} returned no kv_transfer_params (is its KV connector configured?)"
            )
        return params

    def _fallback(self, exc: TandemError, trace: RequestTrace) -> None:
        if self.settings.prefill_fallback is FallbackPolicy.ERROR:
            raise exc
        log.warning("prefill leg failed (%s); prefilling on decode node %s", exc.message, trace.decode_node)
        self.metrics.fallbacks.inc()
        trace.fallback = True
        return None

    def _headers(self, trace: RequestTrace, leg: Literal["prefill", "decode"]) -> dict[str, str]:
        # vLLM names its answer "chatcmpl-<X-Request-Id>" ("cmpl-…" for completions): sending the
        # part after our prefix makes the engine's chunk ids the router's response id, so streamed
        # chunks pass through unchanged (router/edge/sse.py).
        headers = {"X-Request-Id": trace.request_id.partition("-")[2]}
        if not self.settings.otlp_traces_endpoint:
            return headers  # no spans, no header: nothing drawn or formatted
        # W3C trace context naming the router's span of this leg (tandem.prefill or tandem.decode), which
        # an engine with --otlp-traces-endpoint parents its own span on; the accounting gives the
        # router's spans the same ids (telemetry.tracing).
        if trace.trace_id is None or trace.prefill_span_id is None or trace.decode_span_id is None:
            trace.trace_id = random.getrandbits(128) or 1  # 0 is the invalid id
            trace.prefill_span_id = random.getrandbits(64) or 1
            trace.decode_span_id = random.getrandbits(64) or 1
        span = trace.prefill_span_id if leg == "prefill" else trace.decode_span_id
        headers["traceparent"] = f"00-{trace.trace_id:032x}-{span:016x}-01"
        return headers

    def abandon(self, leg: Leg, reason: str, background: Callable[[Awaitable[Any]], None]) -> None:
        """The router gives up on a planned leg: free the prefill node's lease now, off the fast path."""
        params = leg.body.get("kv_transfer_params")
        if is_tandem_params(params):
            background(release_lease(params, reason))

    def _node_failed(self, node: Candidate, exc: UpstreamError) -> None:
        """A leg could not reach ``node`` (no engine answer at all): leave it out of routing now rather
        than when its registry entry lapses. An engine's own error answer says the node is alive."""
        if not isinstance(exc, EngineRejected):
            self.fleet.mark_down(node.node_id, exc.message)

    def _retry_leg(self, leg: Leg, trace: RequestTrace, exc: TandemError) -> Leg:
        """The decode leg failed before any token: serve the request once more, on the prefill node of a
        P/D pair (alive, with the prompt cached), else on another node that can serve it alone."""
        retryable = isinstance(exc, UpstreamError) and not (isinstance(exc, EngineRejected) and exc.status_code < 500)
        if not retryable or self.settings.prefill_fallback is FallbackPolicy.ERROR:
            raise exc
        assert isinstance(exc, UpstreamError)
        failed = leg.decision.decode
        self._node_failed(failed, exc)
        if leg.decision.code is ReasonCode.PINNED:
            raise exc  # its operator asked for that node, no other
        prefill = leg.decision.prefill
        path = leg.url[len(failed.node.info.url) :]
        body = {k: v for k, v in leg.body.items() if k != "kv_transfer_params"}
        # A P/D decode leg (not one that already fell back to colocated, whose body may carry only a
        # retention hint): its prefill node holds the prompt, so it serves the retry.
        if prefill is not None and trace.mode == "disaggregated":
            target, why = prefill, "served by the prefill node"
        else:
            target = self._another_node(trace.model, failed.node_id)
            if target is None:
                raise exc
            why = f"served by {target.node_id}"
        retain = (leg.body.get("kv_transfer_params") or {}).get(RETAIN_FIELD)
        if retain is not None and target.node.info.host_tier_events_endpoint:
            body["kv_transfer_params"] = {RETAIN_FIELD: retain}  # the retry's node keeps the session too
        if trace.peer_node is not None:  # the fetch went with the failed leg: the retry computes or hits
            if trace.prefix_view is not None:
                view = trace.prefix_view
                trace.prefix_view = replace(
                    view, routed_tokens=view.routed_tokens - view.routed_peer_tokens, routed_peer_tokens=0
                )
            trace.peer_node, trace.peer_tokens, trace.kv_params = None, 0, None
        log.warning("decode leg on %s failed (%s); %s", failed.node_id, exc.message, why)
        self.metrics.fallbacks.inc()
        trace.fallback, trace.mode, trace.decode_node = True, "colocated", target.node_id
        trace.decode_role = target.node.info.role.value
        trace.reason = f"{trace.reason}; decode leg failed, {why}"
        return Leg(replace(leg.decision, decode=target, prefill=None), target.node.info.url + path, body)

    def _another_node(self, model: str, failed: str) -> Candidate | None:
        """The least busy node other than ``failed`` that serves ``model`` alone: colocated, else decode,
        else prefill (a prefill engine serves whole requests when no decode node is left)."""
        try:
            pools = self.fleet.pools(model, exclude=frozenset({failed}))
        except TandemError:
            return None
        for pool in (pools.colocated, pools.decode, pools.prefill):
            # Not one that failed a leg moments ago (``pools`` still lists down nodes when all are down).
            options = [c for c in pool if c.node_id != failed and not self.fleet.is_down(c.node_id)]
            if options:
                return min(options, key=lambda c: c.inflight)
        return None

    async def complete(
        self, leg: Leg, trace: RequestTrace, background: Callable[[Awaitable[Any]], None] | None = None
    ) -> dict[str, Any]:
        try:
            try:
                if leg.pair is not None:
                    resp = await leg.pair.claim_decode()
                    # The decode node's whole answer came before the prefill node's one-token answer:
                    # rare, and short (that answer trails the prefill's last layer), but the usage the
                    # client gets names the prefill node's cached tokens.
                    await leg.pair.prefill_ended()
                else:
                    resp = await self._post_decode(leg, trace)
            except UpstreamError as exc:
                if background is not None:
                    self.abandon(leg, f"decode leg failed: {exc.message}", background)
                retry = self._retry_leg(leg, trace, exc)
                if leg.pair is not None:
                    await leg.pair.prefill_ended()  # the retry goes to the prefill node: its prompt cached
                resp = await self._post_decode(retry, trace)
        finally:
            self.policy.on_complete(leg.decision)
        now = time.time()
        trace.first_token = trace.finish = now
        trace.transfer = (resp.pop("kv_transfer_params", None) or {}).get("tandem_transfer")
        resp["id"] = trace.request_id
        record_usage(trace, resp.get("usage"))
        for choice in resp.get("choices") or []:
            trace.finish_reason = choice.get("finish_reason") or trace.finish_reason
            trace.content.append((choice.get("message") or {}).get("content") or choice.get("text") or "")
            for i, call in enumerate((choice.get("message") or {}).get("tool_calls") or []):
                trace.add_tool_call_delta({**call, "index": i})
        return resp

    async def open_stream(
        self,
        leg: Leg,
        trace: RequestTrace,
        stack: AsyncExitStack,
        background: Callable[[Awaitable[Any]], None] | None = None,
    ) -> SseStream:
        """Open the decode stream and wait for its first batch of chunks, so that refusals and a decode node that
        dies before the first token raise here (and can be retried, or answered with a proper HTTP
        status); the stream's lifetime is bound to ``stack``."""
        stack.callback(self.policy.on_complete, leg.decision)
        try:
            if leg.pair is not None:
                stream, attempt = await leg.pair.claim_decode()
            else:
                stream, attempt = await self._open_once(leg, trace)
        except UpstreamError as exc:
            if background is not None:
                self.abandon(leg, f"decode leg failed: {exc.message}", background)
            retry = self._retry_leg(leg, trace, exc)
            if leg.pair is not None:
                await leg.pair.prefill_ended()  # the retry goes to the prefill node: its prompt cached
            stream, attempt = await self._open_once(retry, trace)
        stack.push_async_exit(attempt)
        # vLLM sends a stream's first event with its first token: the prompt's work is done.
        self.policy.on_prefilled(leg.decision)
        return stream

    async def _open_once(self, leg: Leg, trace: RequestTrace) -> tuple[SseStream, AsyncExitStack]:
        """The stream, opened up to its first events, and the stack that closes it."""
        body = dict(leg.body)
        body["stream"] = True
        # Always ask the engine for usage (telemetry needs it); it is only forwarded if the client asked.
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        attempt = AsyncExitStack()
        try:
            attempt.enter_context(self.fleet.track(leg.decision.decode))
            stream = await attempt.enter_async_context(
                self.client.open_stream(leg.url, body, self._headers(trace, "decode"))
            )
            await stream.first()
        except BaseException:
            await attempt.aclose()
            raise
        return stream, attempt


def note_resolution(trace: RequestTrace, resolution: Resolution) -> None:
    """The resolved model into the trace: what answers, what was asked for, and how one became the other."""
    trace.model, trace.model_resolution = resolution.served, resolution.via.value
    trace.requested_model = resolution.requested


def note_decision(trace: RequestTrace, decision: Decision) -> None:
    """The routing decision into the trace, as data (codes and figures) and as a sentence."""
    trace.policy, trace.reason = decision.policy, decision.reason
    trace.reason_code, trace.decode_reason_code = decision.code, decision.decode_code
    trace.reason_threshold, trace.reason_load = decision.threshold, decision.load


def note_rates(rates: FetchRates, trace: RequestTrace) -> None:
    """What a finished request measured for ``router.planning.peer_fetch``: a colocated prefill's time per uncached
    token, or a peer fetch's transfer time per token moved."""
    if trace.status != "ok" or trace.mode != "colocated" or trace.decode_node is None:
        return
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
        trace.engine_cached_tokens = details.get("cached_tokens")
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
